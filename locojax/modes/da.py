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

A local Ray instance is started (no dashboard, token auth off, nothing left in the home directory)
unless the spec names a cluster address; actors then land on hosts through the custom resources
`locojax_rollout` / `locojax_train` that each cluster node advertises.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from locojax import metrics as m
from locojax.modes.run_files import RunResult, cancel_requested, finish, make_logger, start_output
from locojax.spec import RunSpec

STALENESS_KEY = m.DA_STALENESS
ACTOR_TIMEOUT_S = 600.0  # a single rollout or train call longer than this is treated as hung


class DAError(RuntimeError):
    """A host of a DA run failed; the message names the host and the phase."""


def _pin_and_configure(cores: Sequence[int] | None, devices: int) -> None:
    if cores:
        os.sched_setaffinity(0, list(cores))
    import jax

    jax.config.update("jax_num_cpu_devices", devices)


class RolloutHost:
    """One rollout host: samples, scores and normalises its shard of each step's prompts."""

    def __init__(self, spec_json: dict, index: int, num_rollout_hosts: int, cores: Sequence[int] | None,
                 reward_modules: Sequence[str] = ()):
        _pin_and_configure(cores, spec_json["placement"]["devices_per_host"])
        import concurrent.futures

        import jax

        from locojax.modes.common import RolloutRunner, load_policy
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
        self.version = 0  # how many updates the loaded weights have seen
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")

    def load_weights(self, flat: list[np.ndarray], version: int) -> float:
        import jax

        start = time.perf_counter()
        treedef = jax.tree.structure(self.params)
        self.params = jax.block_until_ready(jax.device_put(jax.tree.unflatten(treedef, flat), self.runner.replicated))
        self.version = version
        return time.perf_counter() - start

    def sample(self, step: int) -> dict[str, Any]:
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
                "checksum": params_checksum(self.params)}


class TrainHost:
    """One train host; with several, they form one multi-controller JAX job among themselves."""

    def __init__(self, spec_json: dict, index: int, num_train_hosts: int, coordinator: str | None,
                 cores: Sequence[int] | None, out_dir: str, resume: bool):
        _pin_and_configure(cores, spec_json["placement"]["devices_per_host"])
        import jax

        if num_train_hosts > 1:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_train_hosts,
                                       process_id=index)
        from locojax.modes.common import prepare_trainer

        self.spec = RunSpec.model_validate(spec_json)
        self.index = index
        self.trainer = prepare_trainer(self.spec, jax.devices(), Path(out_dir) / "checkpoints", resume)

    def start_step(self) -> int:
        return self.trainer.start_step

    def weights(self) -> list[np.ndarray]:
        """The current params as host arrays, in tree order (what rollout hosts load)."""
        import jax

        return [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(self.trainer.state.params)]

    def version(self) -> int:
        import jax

        return int(jax.device_get(self.trainer.state.step))

    def train(self, rows: dict[str, np.ndarray], sampled_version: int, final: bool) -> dict[str, float]:
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
        checkpoint_start = time.perf_counter()
        self.trainer.checkpoint(self.spec, force=final)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out.update({m.TIME_TRAIN: train_s, m.TIME_CHECKPOINT: time.perf_counter() - checkpoint_start,
                    STALENESS_KEY: float(staleness), "params/checksum": params_checksum(self.trainer.state.params)})
        return out

    def close(self) -> int | None:
        self.trainer.checkpoints.close()
        return self.trainer.checkpoints.latest_step()


def split_hosts(spec: RunSpec) -> tuple[int, int]:
    rollout_hosts = spec.placement.rollout_hosts
    return rollout_hosts, spec.placement.hosts - rollout_hosts


def _private_ray_auth() -> None:
    """Token auth for a private Ray: one random token per engine process, set before `import ray`
    (Ray reads its auth mode when it is imported), inherited by the Ray processes this one starts."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def _start_ray(total_cpus: int, ray_address: str | None):
    """Join the operator's Ray cluster (`ray_address`, never a spec field: results from it are
    unpickled), or start a private one for this run: bound to 127.0.0.1, with Ray's token auth on under
    a fresh random token that only this process and the Ray processes it starts hold (in their
    environment, not in a file under the home directory, where Ray 2.60 would otherwise write one)."""
    import ray

    if ray.is_initialized():
        return False
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return True
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


def run_da(
    spec: RunSpec,
    *,
    resume: bool = False,
    console: bool = True,
    cancel_file: str | Path | None = None,
    extra_sinks: Sequence[m.MetricSink] = (),
    ray_address: str | None = None,
) -> RunResult:
    """`ray_address`: an operator's Ray cluster (the `--ray-address` of `locojax train`); default: a
    private one on this host."""
    if not ray_address:
        _private_ray_auth()
    import ray

    from locojax.rewards import allowed_reward_modules

    from locojax.launch import cores_for_host, free_port

    if spec.algo.kl_coef > 0:
        raise NotImplementedError("DA mode does not implement the KL reference yet; use kl_coef 0")
    rollout_hosts, train_hosts = split_hosts(spec)
    hosts = spec.placement.hosts
    out = start_output(spec, 0)
    started_ray = _start_ray(max(hosts, os.cpu_count() or 1), ray_address)
    local = not ray_address
    spec_json = spec.model_dump(mode="json")
    coordinator = f"127.0.0.1:{free_port()}" if train_hosts > 1 else None

    def cores(host: int):
        return cores_for_host(host, hosts) if local else None

    rollout_cls = ray.remote(num_cpus=0, resources={"locojax_rollout": 1})(RolloutHost)
    train_cls = ray.remote(num_cpus=0, resources={"locojax_train": 1})(TrainHost)
    rollout_names = [f"rollout host {i}" for i in range(rollout_hosts)]
    train_names = [f"train host {i}" for i in range(train_hosts)]
    actors: list = []
    logger = None
    status, steps_done, combined = "succeeded", 0, {}
    try:
        rollout = [rollout_cls.remote(spec_json, i, rollout_hosts, cores(i), allowed_reward_modules())
                   for i in range(rollout_hosts)]
        train = [train_cls.remote(spec_json, i, train_hosts, coordinator, cores(rollout_hosts + i), str(out), resume)
                 for i in range(train_hosts)]
        actors = rollout + train
        start_step = _wait_each(ray, [t.start_step.remote() for t in train], train_names, "start-up")[0]
        logger = make_logger(spec, out, 0, start_step, console, extra_sinks)

        def push_weights() -> float:
            start = time.perf_counter()
            weights = ray.put(_get(ray, train[0].weights.remote(), train_names[:1], "weight publish"))
            version = _get(ray, train[0].version.remote(), train_names[:1], "weight publish")
            _wait_each(ray, [r.load_weights.remote(weights, version) for r in rollout], rollout_names, "weight load")
            return time.perf_counter() - start

        initial_sync = push_weights() if start_step > 0 else 0.0
        next_batch = [r.sample.remote(start_step) for r in rollout]
        steps_done = start_step
        previous_window = 0.0
        for step in range(start_step, spec.steps):
            step_start = time.perf_counter()
            wait_start = time.perf_counter()
            pieces = _wait_each(ray, next_batch, rollout_names, f"rollout of step {step}")
            train_idle = time.perf_counter() - wait_start
            # This batch was sampled while the previous train step and weight push ran; whatever of
            # that window the rollout did not need, the rollout group sat idle.
            rollout_busy = max(p["metrics"][m.TIME_STEP] for p in pieces)
            rollout_idle = max(0.0, previous_window - rollout_busy) if step > start_step else 0.0
            rows = {k: np.concatenate([p["rows"][k] for p in pieces]) for k in pieces[0]["rows"]}
            per_train = len(rows["tokens"]) // train_hosts
            final = step + 1 == spec.steps
            train_refs = [t.train.remote({k: v[i * per_train:(i + 1) * per_train] for k, v in rows.items()},
                                         pieces[0]["version"], final) for i, t in enumerate(train)]
            # Overlap: batch t+1 is sampled with θ_t while the train group turns batch t into θ_{t+1}.
            overlap_start = time.perf_counter()
            next_batch = [r.sample.remote(step + 1) for r in rollout] if not final else []
            train_metrics = _wait_each(ray, train_refs, train_names, f"train step {step}")[0]
            sync_s = push_weights() if next_batch else 0.0
            step_s = time.perf_counter() - step_start + (initial_sync if step == start_step else 0.0)
            record = m.aggregate_hosts([p["metrics"] for p in pieces])
            record.update(train_metrics)
            record[m.TIME_WEIGHT_SYNC] = sync_s
            record[m.DA_TRAIN_IDLE] = train_idle
            record[m.DA_ROLLOUT_IDLE] = rollout_idle
            previous_window = time.perf_counter() - overlap_start
            record["da/rollout_checksum"] = pieces[0]["checksum"]
            record["da/rollout_version"] = float(pieces[0]["version"])
            record.update(da_split(step_s, train_metrics[m.TIME_TRAIN], sync_s, record))
            train_tokens = float(rows["prompt_mask"].sum() + rows["completion_mask"].sum())
            record[m.THROUGHPUT_TRAIN_TOKENS] = m.throughput(train_tokens, train_metrics[m.TIME_TRAIN])
            combined = logger.log_hosts(step, [record])
            steps_done = step + 1
            if cancel_requested(cancel_file):
                status = "cancelled"
                break
        last_checkpoint = _wait_each(ray, [t.close.remote() for t in train], train_names, "shutdown")[0]
    finally:
        if logger is not None:
            logger.close()
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started_ray:
            ray.shutdown()
    return finish(out, 0, RunResult(status, steps_done, last_checkpoint, combined))


def da_split(step_s: float, train_s: float, sync_s: float, record: dict[str, float]) -> dict[str, float]:
    """DA's device/host/network split from the driver's view of one step.

    Rollout of the next batch runs under training, so the devices of *some* group are busy for
    max(train, rollout device time); the weight push is network; the rest is host orchestration.
    """
    device_s = min(max(train_s, record.get(m.TIME_DEVICE, 0.0)), max(0.0, step_s - sync_s))
    return m.split_step_time(step_s, device_s, sync_s)
