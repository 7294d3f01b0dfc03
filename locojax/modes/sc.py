"""SC (single controller): the baseline a single-controller system pays, kept for honest comparison.

One controller process (on the first reserved host) and one worker process per reserved host, in the
shape of verl's single controller over worker groups (the first host's worker is the controller's
child: a host runs one engine start at a time). The workers own every device: together they
form one `jax.distributed` job that holds the policy and optimizer state, as CO's hosts do. The
controller holds no model. Every step it:
  1. dispatches each worker its host's prompts over the network (an authenticated TCP link);
  2. gathers every completion back to itself (token arrays through the sockets, not shared memory);
  3. detokenises, scores and normalises *all* of them on its own CPU;
  4. sends each worker its rows of the global batch and has them run the same jitted train step
     (CO's kernel, on the same mesh), and collects the train metrics.
Nothing is slowed down on purpose: SC pays only for what a single controller must do itself. The
workers' own device seconds come back with their answers, so the step splits into device (the
slowest worker's), network (the rest of the wait) and host (the controller's own work).

`locojax train` of an SC spec starts its workers itself (pinned to their simulated hosts' cores, on
a loopback port); under the control plane every reserved host's worker starts one (`locojax
sc-worker`) and they connect to the controller's published address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from locojax import link
from locojax.launch import cores_for_host
from locojax import metrics as m
from locojax.contract import CHECKSUM_KEY, CONTROL_DIR, EngineStatus, HostStatus
from locojax.modes.errors import SCError
from locojax.runner import ModeSession, StepOutput, checkpoint_dir, checksum_due, output_dir
from locojax.spec import RunSpec, dump_spec

CONNECT_TIMEOUT_S = 300.0  # workers compile nothing before they connect, but may queue for cores
SETUP_TIMEOUT_S = 900.0  # a worker's setup: policy, optimizer state, restore (0.6B restores take minutes)
CALL_TIMEOUT_S = 600.0  # one rollout or train call longer than this is treated as a hung worker
STOP_TIMEOUT_S = 30.0  # a worker asked to stop that has not exited by then is killed


# ---------------------------------------------------------------------------------------------
# The controller


class SCSession(ModeSession):
    """The controller of an SC run: it owns the run loop, the prompts, the rewards and the metrics;
    its workers own the devices."""

    def __init__(self, spec: RunSpec, *, resume: bool = False, listen: str | None = None,
                 secret_file: str | Path | None = None):
        from locojax.modes.common import reward_pool
        from locojax.tasks import load_task_data
        from locojax.tokenizer import load_tokenizer

        self.spec, self.hosts = spec, spec.placement.hosts
        self.step_index = 0
        self.tokenizer = load_tokenizer(spec.model.tokenizer)
        self.task = load_task_data(spec.task, spec.eval).train
        self.rows_per_host = spec.rollout.prompts_per_step // self.hosts * spec.rollout.group_size
        self.pool = reward_pool()
        self.children: list[subprocess.Popen] = []
        self.connections: list[Connection] = []
        self.lost_ranks: set[int] = set()  # workers whose link closed under them: their process died
        self.worker_rows: list[dict[str, float]] = []
        try:
            if listen is None:  # `locojax train`: start every worker here, each pinned to its host's cores
                secret = link.new_secret().encode()
                listener = link.listen("127.0.0.1:0", secret)
                address = "%s:%d" % listener.address
                # Every worker's cores first: `cores_for_host` splits this process's affinity, so once
                # the controller sits on the first host's cores every worker would land there too.
                placed = [(rank, cores_for_host(rank, self.hosts)) for rank in range(self.hosts)]
                os.sched_setaffinity(0, placed[0][1])  # the controller sits on the first host
                self.children = self._start_workers(spec, address, self._write_secret(spec, secret), resume,
                                                    placed)
            else:
                # The control plane started this controller on the first reserved host, and the other
                # hosts' workers, which connect to the address it published. The first host's worker
                # is this process's child, on the same cores (a host runs one start message at a time).
                if secret_file is None:
                    raise ValueError("an SC controller that listens for its workers needs --secret-file")
                secret = link.read_secret(secret_file)
                listener = link.listen(listen, secret)
                address = listen
                self.children = self._start_workers(spec, address, Path(secret_file), resume,
                                                    [(0, sorted(os.sched_getaffinity(0)))])
            with listener:
                connections = link.accept(listener, self.hosts, CONNECT_TIMEOUT_S,
                                          lambda: (dead := self._dead_child()) and f"{dead} during start-up")
            self.connections = self._hello(connections, address)
            ready = self._receive_all("setup", SETUP_TIMEOUT_S)
            starts = {answer["start_step"] for answer in ready}
            if len(starts) != 1:
                raise SCError(f"the workers restored different steps {sorted(starts)}")
            self.start_step = starts.pop()
        except BaseException:
            self.close()
            raise

    # --- setup ---

    def _write_secret(self, spec: RunSpec, secret: bytes) -> Path:
        control = output_dir(spec) / CONTROL_DIR
        control.mkdir(parents=True, exist_ok=True)
        path = control / "sc-secret"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secret)
        self._secret_path = path  # removed again when the run ends
        return path

    def _start_workers(self, spec: RunSpec, address: str, secret_path: Path, resume: bool,
                       placed: Sequence[tuple[int, Sequence[int]]]) -> list[subprocess.Popen]:
        """Start the workers of `placed` (rank, cores) here, as children that die with this process."""
        control = output_dir(spec) / CONTROL_DIR
        control.mkdir(parents=True, exist_ok=True)
        spec_path = control / "sc-worker-spec.yaml"
        spec_path.write_text(dump_spec(spec), encoding="utf-8")
        children = []
        for rank, cores in placed:
            command = [sys.executable, "-m", "locojax.cli", "sc-worker", str(spec_path), "--controller", address,
                       "--process-id", str(rank), "--devices-per-host", str(spec.placement.devices_per_host),
                       "--secret-file", str(secret_path), "--quiet"] + (["--resume"] if resume else [])
            children.append(subprocess.Popen(command, start_new_session=True,
                                             preexec_fn=lambda cores=cores: _pin_and_die_with_parent(cores)))
        return children

    def _dead_child(self) -> str | None:
        """Which worker started here has exited (and how), or None."""
        for rank, child in enumerate(self.children):
            code = child.poll()
            if code is not None:
                return f"SC worker {rank} (pid {child.pid}) exited with {_exit_text(code)}"
        return None

    def _hello(self, connections: Sequence[Connection], address: str) -> list[Connection]:
        """Order the workers by rank (host h's worker is rank h: its process index in the run, or its
        child index here) and tell each the coordinator of their `jax.distributed` job (rank 0's, on
        this host)."""
        from locojax.launch import free_port

        by_index: dict[int, tuple[Connection, dict]] = {}
        for connection in connections:
            hello = link.receive(connection, 60.0, "an SC worker's hello")
            by_index[int(hello["process_index"])] = (connection, hello)
        if sorted(by_index) != list(range(self.hosts)):
            raise SCError(f"SC workers of ranks {sorted(by_index)} connected; expected 0..{self.hosts - 1}")
        host, _ = link.split_address(address)
        coordinator = f"{host}:{free_port()}"
        ordered = []
        self.worker_hosts = []
        for rank in range(self.hosts):
            connection, hello = by_index[rank]
            link.send(connection, {"rank": rank, "workers": self.hosts, "coordinator": coordinator}, "hello")
            ordered.append(connection)
            self.worker_hosts.append(str(hello.get("host", "?")))
        return ordered

    # --- calls ---

    def _describe(self, rank: int) -> str:
        where = self.worker_hosts[rank] if rank < len(getattr(self, "worker_hosts", [])) else "?"
        return f"SC worker {rank} on {where}"

    def _receive(self, rank: int, phase: str) -> Any:
        """Rank's answer, which `_receive_all` found waiting (an answer, or the link closed)."""
        try:
            answer = link.receive(self.connections[rank], 0.0, phase)
        except link.LinkError as exc:
            if isinstance(exc, link.LinkLost):  # not a timeout: a hung worker still gets its stop deadline
                self.lost_ranks.add(rank)
            dead = self._dead_child()
            raise SCError(f"{self._describe(rank)} was lost during {phase} of step {self.step_index}: {exc}"
                          + (f"; {dead}" if dead else "")) from None
        if isinstance(answer, dict) and "error" in answer:
            failed = f"{self._describe(rank)} failed during {phase} of step {self.step_index}: {answer['error']}"
            lost = self._lost_worker(exclude=rank)
            if lost is not None:  # a collective failed because a peer died: name the peer first
                raise SCError(f"{self._describe(lost)} was lost during {phase} of step {self.step_index}; "
                              f"then {failed}")
            raise SCError(failed)
        return answer

    def _lost_worker(self, exclude: int) -> int | None:
        """A worker whose link has closed (its process died), other than `exclude`, or None."""
        for rank, connection in enumerate(self.connections):
            if rank == exclude:
                continue
            try:
                if connection.poll(1.0):
                    connection.recv()
            except (EOFError, OSError):
                self.lost_ranks.add(rank)
                return rank
        return None

    def _call_all(self, messages: Sequence[dict], phase: str) -> list[Any]:
        for rank, message in enumerate(messages):
            try:
                link.send(self.connections[rank], message, phase)
            except link.LinkError as exc:
                if isinstance(exc, link.LinkLost):
                    self.lost_ranks.add(rank)
                raise SCError(f"{self._describe(rank)} was lost during {phase} of step {self.step_index}: "
                              f"{exc}") from None
        return self._receive_all(phase)

    def _receive_all(self, phase: str, timeout_s: float = CALL_TIMEOUT_S) -> list[Any]:
        """Every worker's answer to one call (or to setup), taken as they arrive. Waiting on rank 0 first
        hid a dead rank 1 while rank 0 sat in a collective with it (a checkpoint's barrier) until JAX's
        heartbeat timed out, over a minute; a link that closes is now seen, and named, the moment it does."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < self.hosts:
            pending = {self.connections[rank]: rank for rank in range(self.hosts) if rank not in answers}
            ready = connection_wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                rank = min(pending.values())
                raise SCError(f"{self._describe(rank)} was lost during {phase} of step {self.step_index}: "
                              f"no answer within {timeout_s:g} s")
            for connection in ready:
                answers[pending[connection]] = self._receive(pending[connection], phase)
        return [answers[rank] for rank in range(self.hosts)]

    # --- the step ---

    def step(self, step: int, timer: m.PhaseTimer, where: HostStatus) -> StepOutput:
        from locojax.modes.common import HostRollout, prompts_for, score_and_normalise
        from locojax.rollout import RolloutResult, decode_completions

        spec, hosts = self.spec, self.hosts
        self.step_index = step
        where(step, "rollout")
        with timer.phase(m.TIME_ROLLOUT):
            examples = [prompts_for(self.task, spec, step, h, hosts) for h in range(hosts)]
            start = timer.clock()
            answers = self._call_all([{"call": "rollout", "step": step, "examples": examples[h]}
                                      for h in range(hosts)], "rollout")
            timer.credit_wait(timer.clock() - start, max(a["device_s"] for a in answers))
            results = [RolloutResult(*(np.asarray(a[f]) for f in ("tokens", "logprobs", "mask", "lengths")))
                       for a in answers]
            completions = [decode_completions(result, self.tokenizer) for result in results]
        rollout_s = timer.last_phase(m.TIME_ROLLOUT)
        where(step, "reward")
        all_examples = [e for host_examples in examples for e in host_examples]
        all_completions = [c for host_completions in completions for c in host_completions]
        rewards, per_fn, advantages = score_and_normalise(
            spec, self.task, all_examples, all_completions, self.pool, timer)
        pieces = []
        for h in range(hosts):
            rows = slice(h * self.rows_per_host, (h + 1) * self.rows_per_host)
            pieces.append(HostRollout(
                examples[h], answers[h]["prompt_tokens"], answers[h]["prompt_mask"], results[h], completions[h],
                rewards[rows], {name: values[rows] for name, values in per_fn.items()}, advantages[rows]))
        where(step, "train")
        checksum = checksum_due(spec, step)
        with timer.phase(m.TIME_TRAIN):
            start = timer.clock()
            trained = self._call_all([{"call": "train", "step": step, "rows": piece.batch(), "checksum": checksum}
                                      for piece in pieces], "train")
            timer.credit_wait(timer.clock() - start, max(a["device_s"] for a in trained))
        everything = HostRollout(all_examples, np.concatenate([p.prompt_tokens for p in pieces]),
                                 np.concatenate([p.prompt_mask for p in pieces]),
                                 RolloutResult(*(np.concatenate([getattr(r, f) for r in results])
                                                 for f in ("tokens", "logprobs", "mask", "lengths"))),
                                 all_completions, rewards, per_fn, advantages)
        record = {**everything.metrics(spec.rollout.group_size, rollout_s, self.tokenizer.eos_id),
                  **trained[0]["metrics"]}
        if checksum:
            record[CHECKSUM_KEY] = trained[0]["checksum"]
        # Each worker's own figures: host h's row is worker h's (host 0's also holds the controller's record).
        self.worker_rows = []
        for h in range(hosts):
            row = {m.SC_WORKER_SAMPLE: answers[h]["device_s"], m.SC_WORKER_TRAIN: trained[h]["device_s"]}
            if checksum:
                row[CHECKSUM_KEY] = trained[h]["checksum"]
            self.worker_rows.append(row)
        tokens = sum(int(p.prompt_mask.sum() + np.asarray(p.result.mask).sum()) for p in pieces)
        return StepOutput(record, tokens)

    def gather(self, record):
        # One row per reserved host: host 0's is the controller's record with its worker's figures, then
        # each other host's worker. The run loop asks twice per step (values, then times).
        rows = [dict(row) for row in self.worker_rows] or [{}]
        rows[0] = {**rows[0], **record}
        return rows

    def checkpoint(self, force: bool) -> None:
        self._call_all([{"call": "checkpoint", "force": force}] * self.hosts, "checkpoint")

    def finish(self, status: EngineStatus, steps_done: int, where: HostStatus) -> int | None:
        answers = self._call_all([{"call": "finish"}] * self.hosts, "finish")
        return answers[0]["last_checkpoint"]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        # Once a worker died (its process exited before it was asked to stop, or its link closed), the
        # others are one `jax.distributed` job short: whatever they still do together (a checkpoint's
        # commit, closing their checkpoints, JAX's exit-time shutdown barrier) waits for the dead one
        # until its own timeout, minutes. Waiting for them would only sit out the stop deadline, so they
        # are killed at once; a worker that is merely slow or hung, with every peer alive, still gets
        # STOP_TIMEOUT_S to exit. Nothing of theirs is lost: a checkpoint is only committed by all.
        peer_lost = bool(self.lost_ranks) or self._dead_child() is not None
        for connection in self.connections:
            try:
                connection.send({"call": "stop"})
            except (OSError, EOFError, ValueError):
                pass
        for child in self.children:
            if peer_lost:
                if child.poll() is None:
                    _kill_group(child)
                continue
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill_group(child)
        for connection in self.connections:
            connection.close()
        self.connections = []
        if getattr(self, "_secret_path", None) is not None:
            self._secret_path.unlink(missing_ok=True)
        for child in self.children:
            if child.poll() is None:
                _kill_group(child)


def _exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit status {code}"


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _pin_and_die_with_parent(cores: Sequence[int]) -> None:
    import ctypes

    os.sched_setaffinity(0, list(cores))
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# A worker


class SCWorker:
    """One reserved host's worker: it samples its host's prompts and trains its rows of the global
    batch when the controller says so. With several workers they are one `jax.distributed` job,
    like CO's hosts, so the train step is CO's SPMD step on the same mesh."""

    def __init__(self, spec: RunSpec, rank: int, workers: int, resume: bool):
        import jax

        from locojax.modes.common import RolloutRunner, prepare_trainer, to_local, train_temperature
        from locojax.train import reference_logprobs_fn

        self.spec, self.rank, self.workers = spec, rank, workers
        self.trainer = prepare_trainer(spec, jax.devices(), checkpoint_dir(spec), resume)
        prompts_per_host = spec.rollout.prompts_per_step // workers
        self.rows_per_host = prompts_per_host * spec.rollout.group_size
        self.runner = RolloutRunner(spec, self.trainer.policy, prompts_per_host, jax.local_devices())
        self.use_kl = spec.algo.kl_coef > 0
        if self.use_kl:  # as in CO: the starting policy, scored on this host's rows
            self.reference_params = to_local(self.trainer.reference_params, self.runner.replicated)
            self.reference_logprobs = reference_logprobs_fn(self.trainer.policy.graphdef, train_temperature(spec))

    def rollout(self, step: int, examples) -> dict[str, Any]:
        import time

        import jax

        from locojax.modes.common import to_local
        from locojax.rollout import rollout_key

        start = time.perf_counter()
        local_params = to_local(self.trainer.state.model_params, self.runner.replicated)
        tokens, mask, result = self.runner.sample(local_params, examples, rollout_key(self.spec.seed, step),
                                                  self.rank * self.rows_per_host)
        result = jax.device_get(jax.block_until_ready(result))
        device_s = time.perf_counter() - start
        return {"prompt_tokens": np.asarray(tokens), "prompt_mask": np.asarray(mask), "device_s": device_s,
                **{f: np.asarray(getattr(result, f)) for f in ("tokens", "logprobs", "mask", "lengths")}}

    def train(self, rows: dict[str, np.ndarray], checksum: bool) -> dict[str, Any]:
        import time

        import jax

        from locojax.modes.common import params_checksum

        start = time.perf_counter()
        if self.use_kl:
            rows["ref_logprobs"] = np.asarray(jax.block_until_ready(self.reference_logprobs(
                self.reference_params, rows["tokens"], rows["prompt_mask"], rows["completion_mask"])))
        trainer = self.trainer
        trainer.state, train_metrics = trainer.train_step(trainer.state, trainer.global_batch(rows))
        jax.block_until_ready(trainer.state)
        device_s = time.perf_counter() - start
        answer = {"metrics": {k: float(v) for k, v in jax.device_get(train_metrics).items()}, "device_s": device_s}
        if checksum:
            answer["checksum"] = float(params_checksum(trainer.state.params))
        return answer

    def serve(self, connection: Connection) -> None:
        """Answer the controller's calls until it says stop (or goes away: then raise)."""
        link.send(connection, {"start_step": self.trainer.start_step}, "ready")
        while True:
            message = link.receive(connection, 7 * 24 * 3600.0, "waiting for the controller")
            call = message["call"]
            if call == "stop":
                return
            try:
                if call == "rollout":
                    answer = self.rollout(message["step"], message["examples"])
                elif call == "train":
                    answer = self.train(message["rows"], message["checksum"])
                elif call == "checkpoint":
                    self.trainer.checkpoint(self.spec, force=message["force"])
                    answer = {}
                elif call == "finish":
                    self.trainer.checkpoints.wait_until_finished()
                    answer = {"last_checkpoint": self.trainer.checkpoints.latest_step()}
                else:
                    answer = {"error": f"unknown call {call!r}"}
            except Exception as exc:  # noqa: BLE001  (reported to the controller, then re-raised here)
                link.send(connection, {"error": f"{type(exc).__name__}: {exc}"}, call)
                raise
            link.send(connection, answer, call)

    def close(self) -> None:
        self.trainer.checkpoints.close()


def serve_worker(spec: RunSpec, controller: str, secret: bytes, process_index: int, resume: bool) -> None:
    """`locojax sc-worker`: connect to the controller, join the workers' job, serve until stopped."""
    import socket

    import jax

    connection = link.connect(controller, secret, CONNECT_TIMEOUT_S)
    try:
        link.send(connection, {"process_index": process_index, "host": socket.gethostname(), "pid": os.getpid()},
                  "hello")
        hello = link.receive(connection, CONNECT_TIMEOUT_S, "the controller's hello")
        workers = int(hello["workers"])
        if workers > 1:
            # Rank 0 runs the coordination service: at the address it publishes, not on every interface.
            jax.distributed.initialize(coordinator_address=hello["coordinator"], num_processes=workers,
                                       process_id=int(hello["rank"]),
                                       coordinator_bind_address=hello["coordinator"] if int(hello["rank"]) == 0
                                       else None)
        worker = SCWorker(spec, int(hello["rank"]), workers, resume)
        try:
            worker.serve(connection)
        finally:
            worker.close()
        if workers > 1:
            jax.distributed.shutdown()
    finally:
        connection.close()
