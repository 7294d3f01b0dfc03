"""DA (disaggregated): rollout hosts and train hosts as Ray actors, overlapped (DESIGN §2).

The hosts split into a rollout group (`rollout_fraction` of them) and a train group. Each actor is
its own process with its own devices and cores. The pipeline keeps staleness at most one:

    rollout:  b0(θ0)  b1(θ0)  b2(θ1)  b3(θ2) ...
    train:            b0→θ1   b1→θ2   b2→θ3 ...
    weights:                θ1→R    θ2→R    ...

While the train group consumes batch t (producing θ_{t+1}), the rollout group samples batch t+1 with
θ_t; after the update the new weights are pushed to every rollout host before its next batch. The
train step's ratio against the rollout log-probs is the importance correction for that one step of
staleness. Rewards and advantages are computed on the rollout hosts (host-local, as in CO).

Where the actors run:
  * under the control plane, on the hosts the run reserved: the driver starts a Ray head on the first
    of them and the others join it (locojax.modes.da_cluster); train host j lives on reserved host j
    and rollout host i on reserved host T + i (T train hosts), each on its host's cores;
  * `locojax train` on one machine: a private Ray in the run's own network namespace, each actor
    pinned to its simulated host's share of the cores;
  * `--ray-address`: an operator's cluster, whose nodes advertise `locojax_rollout` / `locojax_train`.
A Ray this run starts has token auth on and leaves nothing in the home directory.

Each step's record holds one row per host (the driver's step-level values in host 0's row, with
train host 0's), so the run has per-host metrics; a value each row has is reduced across hosts, a
value only the driver measures is the aggregate as it is.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from locojax import metrics as m
from locojax.contract import CHECKPOINTS_DIR, CHECKSUM_KEY, DA_ROLLOUT_CHECKSUM, DA_ROLLOUT_VERSION
from locojax.modes.errors import DAError
from locojax.runner import ModeSession, StepOutput, checksum_due
from locojax.spec import RunSpec

STALENESS_KEY = m.DA_STALENESS
ACTOR_TIMEOUT_S = 600.0  # a single rollout or train call longer than this is treated as hung


def _pin_and_configure(cores: Sequence[int] | None, devices: int) -> None:
    if cores:
        os.sched_setaffinity(0, list(cores))
    import jax

    from locojax.compilation_cache import cache_from_every_process

    jax.config.update("jax_num_cpu_devices", devices)
    cache_from_every_process()  # a train actor of index 1 or more reuses its programs too


def _cpu_collectives_on_this_node() -> None:
    """The train hosts' CPU collectives (gloo) on this Ray node's address. By default gloo takes the
    address the machine's hostname resolves to, which is loopback on many machines and containers,
    where the other train hosts cannot reach it. Call after `jax.distributed.initialize`, before JAX
    makes its CPU backend."""
    import ray
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    address = ray.util.get_node_ip_address()

    def cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                      hostname=address)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


class RolloutHost:
    """One rollout host: samples, scores and normalises its shard of each step's prompts."""

    def __init__(self, spec_json: dict, index: int, num_rollout_hosts: int, cores: Sequence[int] | None,
                 reward_modules: Sequence[str] = ()):
        _pin_and_configure(cores, spec_json["placement"]["devices_per_host"])
        import jax

        from locojax.modes.common import RolloutRunner, load_policy, reward_pool
        from locojax.rewards import allow_reward_modules
        from locojax.tasks import make_task

        # An actor is a process of its own: it scores under the allowlist its driver was started with.
        allow_reward_modules(reward_modules)
        self.spec = RunSpec.model_validate(spec_json)
        self.index, self.hosts = index, num_rollout_hosts
        self.policy = load_policy(self.spec)
        self.task = make_task(self.spec.task)
        prompts = self.spec.rollout.prompts_per_step // num_rollout_hosts
        self.rows = prompts * self.spec.rollout.group_size
        self.runner = RolloutRunner(self.spec, self.policy, prompts, jax.local_devices())
        self.params = jax.device_put(self.policy.params, self.runner.replicated)
        # With LoRA only the adapters are trained, so only they are pushed here: the frozen base stays as
        # loaded and each push replaces `self.trained` (the adapters) beside it.
        self.frozen, self.trained = None, self.params
        if self.spec.model.lora is not None:
            from locojax.model.transformer import split_adapters

            self.frozen, self.trained = split_adapters(self.params)
        self.version = 0  # how many updates the loaded weights have seen
        self.pool = reward_pool()

    def load_weights(self, flat: list[np.ndarray], version: int) -> float:
        import jax

        start = time.perf_counter()
        from locojax.train import model_params

        treedef = jax.tree.structure(self.trained)
        if treedef.num_leaves != len(flat):
            raise DAError(f"rollout host {self.index}: {len(flat)} arrays pushed, its trained params have "
                          f"{treedef.num_leaves}")
        self.trained = jax.block_until_ready(jax.device_put(jax.tree.unflatten(treedef, flat), self.runner.replicated))
        self.params = model_params(self.trained, self.frozen)
        self.version = version
        return time.perf_counter() - start

    def sample(self, step: int, checksum: bool = False) -> dict[str, Any]:
        import jax

        from locojax.modes.common import HostRollout, params_checksum, prompts_for, score_and_normalise
        from locojax.rollout import rollout_key

        timer = m.PhaseTimer()
        with timer.step():
            with timer.phase(m.TIME_ROLLOUT):
                examples = prompts_for(self.task, self.spec, step, self.index, self.hosts)
                with timer.device() as span:
                    tokens, mask, result = self.runner.sample(
                        self.params, examples, rollout_key(self.spec.seed, step), self.index * self.rows)
                    span.ready(result)
                completions = self.runner.completions(result)
            rollout_s = timer.last_phase(m.TIME_ROLLOUT)
            rewards, per_fn, advantages = score_and_normalise(self.spec, self.task, examples, completions, self.pool,
                                                              timer)
            piece = HostRollout(examples, tokens, mask, jax.device_get(result), completions, rewards, per_fn,
                                advantages)
        metrics = {**piece.metrics(self.spec.rollout.group_size, rollout_s, self.policy.tokenizer.eos_id),
                   **timer.metrics()}
        return {"rows": piece.batch(), "metrics": metrics, "version": self.version,
                "checksum": float(params_checksum(self.trained)) if checksum else None}


class TrainHost:
    """One train host; with several, they form one multi-controller JAX job among themselves, whose
    coordinator train host 0 opens on its own machine (`coordinator_address`) before `setup`."""

    def __init__(self, spec_json: dict, index: int, num_train_hosts: int, cores: Sequence[int] | None,
                 out_dir: str, resume: bool):
        _pin_and_configure(cores, spec_json["placement"]["devices_per_host"])
        self.spec = RunSpec.model_validate(spec_json)
        self.index, self.hosts, self.out_dir, self.resume = index, num_train_hosts, out_dir, resume

    def coordinator_address(self) -> str:
        """ADDR:PORT for the train hosts' JAX coordinator: this node's address, a port free here."""
        import ray

        from locojax.launch import free_port

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def setup(self, coordinator: str | None) -> int:
        """Join the train hosts' JAX job and restore or initialise the train state; the start step."""
        import jax

        if self.hosts > 1:
            # The coordinator service listens on its node's address only (by default it takes every interface).
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.hosts,
                                       process_id=self.index,
                                       coordinator_bind_address=coordinator if self.index == 0 else None)
            _cpu_collectives_on_this_node()
        from locojax.modes.common import prepare_trainer

        self.trainer = prepare_trainer(self.spec, jax.devices(), Path(self.out_dir) / CHECKPOINTS_DIR, self.resume)
        return self.trainer.start_step

    def weights(self) -> list[np.ndarray]:
        """The trained params (with LoRA: the adapters alone) as host arrays, in tree order (what rollout
        hosts load)."""
        import jax

        from locojax.model.hf import row_major
        from locojax.modes.common import host_copy

        # Row-major copies: a TPU may hand back a column-major view (locojax.model.hf.row_major).
        return [row_major(host_copy(x)) for x in jax.tree.leaves(self.trainer.state.params)]

    def version(self) -> int:
        import jax

        return int(jax.device_get(self.trainer.state.step))

    def train(self, rows: dict[str, np.ndarray], sampled_version: int, checksum: bool = False) -> dict[str, float]:
        import jax

        from locojax.modes.common import params_checksum

        version = self.version()
        staleness = version - sampled_version
        if not 0 <= staleness <= 1:
            raise DAError(f"train host {self.index}: batch sampled with weights v{sampled_version} arrived at "
                          f"v{version} (staleness {staleness} > 1)")
        start = time.perf_counter()
        self.trainer.state, metrics = self.trainer.train_step(self.trainer.state, self.trainer.global_batch(rows))
        jax.block_until_ready(self.trainer.state)
        train_s = time.perf_counter() - start
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out.update({m.TIME_TRAIN: train_s, STALENESS_KEY: float(staleness)})
        if checksum:
            out[CHECKSUM_KEY] = float(params_checksum(self.trainer.state.params))
        return out

    def checkpoint(self, force: bool) -> None:
        """Save when due (or when `force`). The driver asks only once the step's metrics are logged, as
        the loop does for every mode: a save inside the train step would let a host lost before the
        log resume past a step whose metrics never reached `metrics.jsonl`."""
        self.trainer.checkpoint(self.spec, force=force)

    def close(self) -> int | None:
        self.trainer.checkpoints.close()
        return self.trainer.checkpoints.latest_step()


def split_hosts(spec: RunSpec) -> tuple[int, int]:
    rollout_hosts = spec.placement.rollout_hosts
    return rollout_hosts, spec.placement.hosts - rollout_hosts


def _private_ray_auth() -> None:
    """Token auth for a private Ray: one random token per engine process, set before `import ray`
    (Ray reads its auth mode when it is imported), inherited by the Ray processes this one starts.
    Also keeps the private Ray's node address 127.0.0.1 as `_start_ray` gives it: Ray otherwise
    rewrites a loopback node address into the machine's outward one (and then listens on every
    interface); on loopback its GCS, raylet and workers listen on 127.0.0.1 only, also where the
    private network namespace could not be made."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _start_ray(total_cpus: int, ray_address: str | None):
    """Join the operator's Ray cluster (`ray_address`, never a spec field: results from it are
    unpickled), or start a private one for this run: in the run's own network namespace when
    `locojax train` could make one (locojax.private_network), on 127.0.0.1, with Ray's token auth on under
    a fresh random token that only this process and the Ray processes it starts hold (in their
    environment, not in a file under the home directory, where Ray 2.60 would otherwise write one)."""
    import ray

    if ray.is_initialized():
        return False
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return True
    from locojax import private_network

    if private_network.inside():
        private_network.loopback_up()
    ray.init(num_cpus=total_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             resources={"locojax_rollout": 64, "locojax_train": 64}, configure_logging=False)
    return True


def _get(ray, refs, host_names: Sequence[str], phase: str, timeout: float = ACTOR_TIMEOUT_S):
    """ray.get that turns an actor death or a hang into a DAError naming the host and phase."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise DAError(f"{', '.join(host_names)}: no answer in {timeout:.0f} s during {phase}") from None
    except ray.exceptions.RayActorError as exc:
        raise DAError(f"{', '.join(host_names)} died during {phase}: {exc.__class__.__name__}") from None
    except ray.exceptions.RayTaskError as exc:
        raise DAError(f"{', '.join(host_names)} failed during {phase}: {exc.cause!r}") from None


def _wait_each(ray, refs: list, names: list[str], phase: str):
    """Results of `refs`, failing fast on the first host that fails (not after the slowest)."""
    pending = dict(zip(refs, names))
    deadline = time.monotonic() + ACTOR_TIMEOUT_S
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise DAError(f"{', '.join(pending.values())}: no answer in {ACTOR_TIMEOUT_S:.0f} s during {phase}")
        _get(ray, done[0], [pending.pop(done[0])], phase)
    return _get(ray, refs, names, phase)


# Values of a step only the driver measures (its own step time and split, the pipeline's waits and
# versions) or takes from train host 0 (the params' checksum, which the rollout checksum is compared
# with exactly): host 0's row carries them, no other host's row does, so the aggregate is that value.
DRIVER_KEYS = frozenset({m.TIME_STEP, m.TIME_DEVICE, m.TIME_HOST, m.TIME_NETWORK, m.TIME_WEIGHT_SYNC,
                         m.DA_WEIGHT_SYNC_BYTES,
                         m.TIME_CHECKPOINT, m.DA_TRAIN_IDLE, m.DA_ROLLOUT_IDLE, STALENESS_KEY, DA_ROLLOUT_CHECKSUM,
                         DA_ROLLOUT_VERSION, CHECKSUM_KEY})


def host_rows(rollout: Sequence[dict[str, float]], train: Sequence[dict[str, float]],
              driver: dict[str, float]) -> list[dict[str, float]]:
    """One row per reserved host, in host order (train hosts first, then rollout hosts): each host's
    own measurements, without the driver's values; host 0's row (train host 0's, where the driver runs)
    is `driver` merged over train host 0's."""
    rows = [{k: v for k, v in r.items() if k not in DRIVER_KEYS} for r in [*train, *rollout]]
    rows[0] = {**rows[0], **driver}
    return rows


class DASession(ModeSession):
    """The driver of a DA run: it starts the rollout and train actors and pipelines their steps."""

    def __init__(self, spec: RunSpec, *, resume: bool = False, ray_address: str | None = None,
                 listen: str | None = None, secret_file: str | None = None):
        """`ray_address`: an operator's Ray cluster (the `--ray-address` of `locojax train`); `listen`:
        start this run's Ray head at ADDR:PORT, which the other reserved hosts' nodes join, under the
        attempt's secret (`secret_file`) as Ray's token (the control plane's layout); default: a private
        Ray on this host."""
        from locojax.modes import da_cluster

        if listen:
            if not secret_file:
                raise ValueError("a DA run's Ray head needs the attempt's secret (--secret-file)")
            da_cluster.use_secret_as_token(secret_file)
            da_cluster.connect_as_driver(listen)
        elif not ray_address:
            _private_ray_auth()
        import ray

        from locojax.launch import cores_for_host
        from locojax.rewards import allowed_reward_modules
        from locojax.runner import output_dir

        if spec.algo.kl_coef > 0:
            raise NotImplementedError("DA mode does not implement the KL reference yet; use kl_coef 0")
        self.spec, self.ray = spec, ray
        self.rollout_hosts, self.train_hosts = split_hosts(spec)
        hosts = spec.placement.hosts
        out = output_dir(spec)
        self.actors: list = []
        self.head = None  # this run's Ray head, when the driver started one for the reserved hosts
        self.started_ray = False
        self.pending_rows: list[dict[str, float]] | None = None  # this step's per-host rows, until gathered
        self.step_keys: set[str] = set()
        try:
            if listen:
                self.head = da_cluster.start_head(spec, listen)
                ray.init(address=listen, _node_ip_address=da_cluster.split_address(listen)[0], log_to_driver=False,
                         configure_logging=False)
                self.started_ray = True
                da_cluster.wait_for_nodes(ray, spec)
            else:
                self.started_ray = _start_ray(max(hosts, os.cpu_count() or 1), ray_address)
            spec_json = spec.model_dump(mode="json")

            def cores(host: int):  # only a private Ray pins: a cluster node's actors have their worker's cores
                return cores_for_host(host, hosts) if not (listen or ray_address) else None

            def placed(cls, group: str, host: int):
                # On the reserved hosts' cluster an actor goes to its own host; elsewhere to its group.
                resources = {group: 1, **({da_cluster.host_resource(host): 1} if listen else {})}
                return ray.remote(num_cpus=0, resources=resources)(cls)

            self.rollout_names = [f"rollout host {i}" for i in range(self.rollout_hosts)]
            self.train_names = [f"train host {i}" for i in range(self.train_hosts)]
            self.train = [placed(TrainHost, da_cluster.RESOURCE_TRAIN, i).remote(
                spec_json, i, self.train_hosts, cores(i), str(out), resume) for i in range(self.train_hosts)]
            self.rollout = [placed(RolloutHost, da_cluster.RESOURCE_ROLLOUT, self.train_hosts + i).remote(
                spec_json, i, self.rollout_hosts, cores(self.train_hosts + i), allowed_reward_modules())
                for i in range(self.rollout_hosts)]
            self.actors = self.train + self.rollout
            coordinator = (_get(ray, self.train[0].coordinator_address.remote(), self.train_names[:1], "start-up")
                           if self.train_hosts > 1 else None)
            self.start_step = _wait_each(ray, [t.setup.remote(coordinator) for t in self.train], self.train_names,
                                         "start-up")[0]
            self.initial_sync = self.push_weights() if self.start_step > 0 else 0.0
            self.next_batch = [r.sample.remote(self.start_step, checksum_due(spec, self.start_step))
                               for r in self.rollout]
        except BaseException:
            self.close()
            raise
        self.previous_window = 0.0
        self.checkpoint_s = 0.0  # the train group's save before the coming step (the loop's `checkpoint`)

    def checkpoint(self, force: bool) -> None:
        start = time.perf_counter()
        _wait_each(self.ray, [t.checkpoint.remote(force) for t in self.train], self.train_names, "checkpoint")
        self.checkpoint_s += time.perf_counter() - start

    def push_weights(self) -> float:
        ray, start = self.ray, time.perf_counter()
        published = _get(ray, self.train[0].weights.remote(), self.train_names[:1], "weight publish")
        self.sync_bytes = sum(int(w.nbytes) for w in published)
        weights = ray.put(published)
        version = _get(ray, self.train[0].version.remote(), self.train_names[:1], "weight publish")
        _wait_each(ray, [r.load_weights.remote(weights, version) for r in self.rollout], self.rollout_names,
                   "weight load")
        return time.perf_counter() - start

    def step(self, step: int, timer: m.PhaseTimer, where) -> StepOutput:
        ray, spec = self.ray, self.spec
        where(step, "rollout")
        step_start = time.perf_counter()
        wait_start = time.perf_counter()
        pieces = _wait_each(ray, self.next_batch, self.rollout_names, f"rollout of step {step}")
        train_idle = time.perf_counter() - wait_start
        # This batch was sampled while the previous train step and weight push ran; whatever of
        # that window the rollout did not need, the rollout group sat idle.
        rollout_busy = max(p["metrics"][m.TIME_STEP] for p in pieces)
        rollout_idle = max(0.0, self.previous_window - rollout_busy) if step > self.start_step else 0.0
        rows = {k: np.concatenate([p["rows"][k] for p in pieces]) for k in pieces[0]["rows"]}
        per_train = len(rows["tokens"]) // self.train_hosts
        final = step + 1 == spec.steps
        where(step, "train")
        train_refs = [t.train.remote({k: v[i * per_train:(i + 1) * per_train] for k, v in rows.items()},
                                     pieces[0]["version"], checksum_due(spec, step))
                      for i, t in enumerate(self.train)]
        # Overlap: batch t+1 is sampled with θ_t while the train group turns batch t into θ_{t+1}.
        overlap_start = time.perf_counter()
        self.next_batch = [r.sample.remote(step + 1, checksum_due(spec, step + 1))
                           for r in self.rollout] if not final else []
        every_train = _wait_each(ray, train_refs, self.train_names, f"train step {step}")
        train_metrics = every_train[0]
        sync_s = self.push_weights() if self.next_batch else 0.0
        # The save the loop asked for just before this step (the previous step's state) is part of it.
        step_s = (time.perf_counter() - step_start + self.checkpoint_s
                  + (self.initial_sync if step == self.start_step else 0.0))
        record = m.aggregate_hosts([p["metrics"] for p in pieces])
        record.update(train_metrics)
        record[m.TIME_WEIGHT_SYNC] = sync_s
        if sync_s:
            record[m.DA_WEIGHT_SYNC_BYTES] = float(self.sync_bytes)
        record[m.TIME_CHECKPOINT], self.checkpoint_s = self.checkpoint_s, 0.0
        record[m.DA_TRAIN_IDLE] = train_idle
        record[m.DA_ROLLOUT_IDLE] = rollout_idle
        self.previous_window = time.perf_counter() - overlap_start
        if pieces[0]["checksum"] is not None:
            record[DA_ROLLOUT_CHECKSUM] = pieces[0]["checksum"]
        record[DA_ROLLOUT_VERSION] = float(pieces[0]["version"])
        record.update(da_split(step_s, train_metrics[m.TIME_TRAIN], sync_s, record))
        driver = {k: v for k, v in record.items() if k in DRIVER_KEYS}  # record holds train host 0's checksum
        driver[m.TIME_TRAIN] = train_metrics[m.TIME_TRAIN]  # the loop's train throughput is host 0's
        self.pending_rows = host_rows([p["metrics"] for p in pieces], every_train, driver)
        self.step_keys = set(record)
        return StepOutput(record, float(rows["prompt_mask"].sum() + rows["completion_mask"].sum()))

    def gather(self, record):
        """Every reserved host's row of this step (`host_rows`), the first time the loop asks after a
        step; what the loop added to the step's record (its cancel vote) goes to host 0's row, and a
        later call (the loop's own timings) is the driver's alone."""
        rows, self.pending_rows = self.pending_rows, None
        if rows is None:
            return [dict(record)]
        added = {k: v for k, v in record.items() if k not in self.step_keys}
        return [{**rows[0], **added}, *rows[1:]]

    def finish(self, status, steps_done: int, where) -> int | None:
        return _wait_each(self.ray, [t.close.remote() for t in self.train], self.train_names, "shutdown")[0]

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False
        if self.head is not None:
            # The GCS closes its port: every other reserved host's node sees it and stops.
            self.head.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
            self.head = None
            from locojax.modes.da_cluster import stop_ray_leftovers

            stop_ray_leftovers()


def da_split(step_s: float, train_s: float, sync_s: float, record: dict[str, float]) -> dict[str, float]:
    """DA's device/host/network split from the driver's view of one step.

    Rollout of the next batch runs under training, so the devices of *some* group are busy for
    max(train, rollout device time); the weight push is network; the rest is host orchestration.
    """
    device_s = min(max(train_s, record.get(m.TIME_DEVICE, 0.0)), max(0.0, step_s - sync_s))
    return m.split_step_time(step_s, device_s, sync_s)
