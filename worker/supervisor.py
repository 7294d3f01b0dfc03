"""`start_host`: one engine host process of one attempt of a run, from start to exit, told to the API.

The worker never runs engine code in its own process: a JAX peer failure (a dead coordinator, a
collective that aborts) ends the `locojax host` subprocess, not the worker. While the process runs,
the supervisor
  * relays what it writes: `metrics.jsonl` rows (process 0 writes every host's and the aggregate
    rows) in batches, output lines as run events, new checkpoints as checkpoint reports; every post
    is idempotent (metrics upsert on run/step/host/key, events carry sequence numbers), so a retry or a
    restarted attempt re-sending old rows writes nothing twice;
  * polls the run: CANCELLING -> touch the cancel file (the engine stops at its next step boundary),
    then SIGTERM after `cancel_grace_s`, SIGKILL after `term_grace_s` more; a run that moved on (a new
    attempt after a recovery, or a final state) -> the process is stopped at once;
  * reports the process's end (EXITED, FAILED with the phase it was in, or KILLED) after the last
    metrics are delivered, so the run's final transition sees all of them.
When the API is unreachable (database restarting) everything is buffered and retried.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import httpx

from locojax.client import ApiClient, ApiClientError
from locojax.contract import (CHECKPOINTS_DIR, CONTROL_DIR, EXIT_CANCELLED, EXIT_OK, METRICS_FILE,
                              METRICS_PROCESS_INDEX, TERMINAL_STATES, HostProcessStatus, RunStatus, host_index,
                              read_host_status, read_run_marker, run_dir_name, write_run_marker)
from locojax.modes import EngineStart, spec_mode
from locojax.spec import RunSpec, dump_spec

log = logging.getLogger("locojax.worker")

METRICS_BATCH_ROWS = 500
EVENTS_BATCH = 200
EVENT_SEQ_PER_ATTEMPT = 1_000_000_000  # output line n of attempt a has seq a * this + n
# The run is no longer this attempt's to run ("DELETED": the API no longer knows it).
MOVED_ON = frozenset({RunStatus.QUEUED.value, RunStatus.RECOVERING.value, "DELETED",
                      *(status.value for status in TERMINAL_STATES)})


@dataclasses.dataclass
class WorkerContext:
    """What a worker knows about itself; set once by `locojax worker`."""

    host_name: str
    api: ApiClient
    address: str = "127.0.0.1"  # where peers reach this host's JAX coordinator
    devices: int = 1
    poll_s: float = 0.5
    cancel_grace_s: float = 8.0
    term_grace_s: float = 4.0
    report_deadline_s: float = 300.0  # how long a final report keeps being retried (API/database down)
    reward_modules: tuple[str, ...] = ()  # the operator's reward module prefixes, passed to every engine process
    ray_address: str = ""  # the operator's Ray cluster for DA runs; empty: a private one per run
    # The operator's folder of compiled programs this host's runs share; empty: the engine's default
    # (~/.locojax/compilation-cache of the worker's user). Never a spec's choice.
    compilation_cache: str = ""
    engine_env: dict[str, str] = dataclasses.field(default_factory=dict)  # see engine_environment
    runs_root: Path = Path("runs")  # the only directory engine processes of this host write under


# What an engine process may see of its worker's environment: how to find programs and its home, the
# JAX/XLA/accelerator runtime's own variables, and PYTHONPATH when the operator set one. Never the
# worker's token, the broker or database URL, or any password (DESIGN §7: hosts hold no credential).
ENGINE_ENV_NAMES = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "CUDA_VISIBLE_DEVICES")
ENGINE_ENV_PREFIXES = ("JAX_", "XLA_", "TPU_", "LIBTPU_")


def engine_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """The explicit environment of an engine process, from its worker's (`parent`)."""
    env = {name: value for name, value in parent.items()
           if (name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES)) and not name.startswith("LOCOJAX_")}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env["PYTHONUNBUFFERED"] = "1"  # output lines reach the relay as they are written
    return env


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by this user only (created 0600, never world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def _die_with_parent() -> None:
    """Runs in the child before exec: if the worker dies (even by SIGKILL), the kernel kills the host
    process too, so a lost worker never leaves an orphan holding devices and ports."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _retrying(fn: Any, *args: Any, deadline_s: float, what: str, **kwargs: Any) -> Any:
    """Call the API until it answers (transport errors and 5xx are retried with backoff; 4xx are final)."""
    delay, start = 0.2, time.monotonic()
    while True:
        try:
            return fn(*args, **kwargs)
        except ApiClientError as exc:
            if exc.status < 500 or time.monotonic() - start > deadline_s:
                raise
            error: Exception = exc
        except httpx.TransportError as exc:
            if time.monotonic() - start > deadline_s:
                raise
            error = exc
        log.warning("%s failed (%s); retrying in %.1f s", what, error, delay)
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def is_stale_refusal(exc: Exception) -> bool:
    """The API refused a report because its attempt is no longer current (or the run finished): this
    attempt's relays stop, and its process with them (retrying can never succeed)."""
    return isinstance(exc, ApiClientError) and exc.status == 409 and exc.code in ("STALE_ATTEMPT", "RUN_FINISHED")


class MetricsRelay:
    """Tails `metrics.jsonl` and posts complete lines in batches; keeps undelivered rows. Once the API
    says this attempt is stale (409), `stale` is set and nothing more is posted."""

    def __init__(self, api: ApiClient, run_id: int, path: Path, *, attempt: int = 0, host_name: str | None = None):
        self.api, self.run_id, self.path = api, run_id, path
        self.attempt, self.host_name = attempt, host_name
        self.stale = False
        self.offset = 0
        self.pending: list[dict[str, Any]] = []
        self.delivered_steps: set[int] = set()
        self.batch_rows = METRICS_BATCH_ROWS  # halved while the API refuses batches as too large (413)

    def read(self) -> None:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        for line in chunk[:end].splitlines():
            row = _metric_row(line)
            if row is not None:
                self.pending.append(row)

    def flush(self) -> bool:
        """Post what is pending; False when the API could not be reached (kept for the next flush)."""
        while self.pending and not self.stale:
            batch = self.pending[:self.batch_rows]
            try:
                self.api.post_metrics(self.run_id, batch, attempt=self.attempt, host_name=self.host_name)
            except (httpx.TransportError, ApiClientError) as exc:
                if is_stale_refusal(exc):
                    log.warning("run %s attempt %s: metrics refused as stale (%s); relay stopped", self.run_id,
                                self.attempt, exc)
                    self.stale = True
                    self.pending.clear()
                    return True
                if isinstance(exc, ApiClientError) and exc.status == 413 and len(batch) > 1:
                    # The API's limit is in values per request (metrics_batch_max_values); rows with many
                    # keys reach it in fewer rows. Smaller batches, not dropped metrics.
                    self.batch_rows = max(1, len(batch) // 2)
                    continue
                if isinstance(exc, ApiClientError) and exc.status < 500:
                    log.error("metrics batch refused, dropped: %s", exc)  # retrying cannot make it valid
                else:
                    return False
            del self.pending[:len(batch)]
        return True


def _metric_row(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
        step, host = int(record.pop("step")), record.pop("host")
        index = host_index(host)  # the aggregate's rows go under the contract's AGGREGATE_HOST_INDEX
    except (ValueError, KeyError, TypeError):
        return None
    # JSON nulls are the engine's non-finite values; the API stores finite floats only.
    values = {key: float(value) for key, value in record.items()
              if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
    return {"step": step, "host": index, "values": values} if values else None


class OutputRelay:
    """Reads the process's merged stdout/stderr in a thread; posts lines as events with sequence numbers."""

    def __init__(self, api: ApiClient, run_id: int, source: str, seq_base: int, stream: Any, *, attempt: int = 0,
                 host_name: str | None = None):
        self.api, self.run_id, self.source, self.seq_base = api, run_id, source, seq_base
        self.attempt, self.host_name = attempt, host_name
        self.stale = False
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.pending: list[dict[str, Any]] = []
        self.count = 0
        self.tail: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True, name=f"output-{source}")
        self.thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def collect(self) -> None:
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is None or not line.strip():
                continue
            self.count += 1
            self.tail = (self.tail + [line])[-5:]
            level = "error" if line.startswith(("Traceback", "Error", "jax.errors", "RuntimeError")) else "info"
            # The API names the source (this host's process) and stamps the time itself.
            self.pending.append({"message": line[:65536], "level": level, "seq": self.seq_base + self.count})

    def flush(self) -> bool:
        while self.pending and not self.stale:
            batch = self.pending[:EVENTS_BATCH]
            try:
                self.api.post_events(self.run_id, batch, attempt=self.attempt, host_name=self.host_name)
            except (httpx.TransportError, ApiClientError) as exc:
                if is_stale_refusal(exc):
                    log.warning("run %s attempt %s: events refused as stale; relay stopped", self.run_id, self.attempt)
                    self.stale = True
                    self.pending.clear()
                    return True
                if isinstance(exc, ApiClientError) and exc.status < 500:
                    log.error("events batch refused, dropped: %s", exc)
                else:
                    return False
            del self.pending[:len(batch)]
        return True


def check_write_paths(spec: Mapping[str, Any]) -> str | None:
    """The host's own check of where the stored spec would have the engine write, besides the run
    directory the host checks itself: the engine writes checkpoints to `spec.checkpoint.dir` when it is
    set, anywhere. The API refuses every spec that sets it (PATH_NOT_ALLOWED), so a stored spec that does
    was not submitted through it (a forged row); refused the same way. Returns why, or None."""
    checkpoint = spec.get("checkpoint")
    directory = checkpoint.get("dir") if isinstance(checkpoint, Mapping) else None
    if directory is not None:
        return (f"spec.checkpoint.dir is set ({str(directory)[:200]!r}); this host writes checkpoints only to the "
                f"run directory's {CHECKPOINTS_DIR}/, and the API never accepts a spec that sets it")
    return None


class HostSupervisor:
    def __init__(self, context: WorkerContext, *, run_id: int, attempt: int, process_index: int,
                 num_processes: int, role: str, resume: bool, output_dir: str, secret: str = ""):
        self.ctx, self.api = context, context.api
        self.run_id, self.attempt, self.index = run_id, attempt, process_index
        self.num_processes, self.role, self.resume = num_processes, role, resume
        self.out = Path(output_dir)
        self.control = self.out / CONTROL_DIR
        self.cancel_file = self.control / f"cancel-attempt{attempt}-host{process_index}"
        # The attempt's shared secret reaches the engine as a file only its user can read: never in
        # its environment or command line (both are visible to every local user).
        self.secret, self.secret_file = secret, self.control / f"secret-attempt{attempt}-host{process_index}"
        self.process: subprocess.Popen[str] | None = None

    # --- reports ---------------------------------------------------------------------------------

    def report(self, status: HostProcessStatus, *, final: bool = False, **fields: Any) -> None:
        status = HostProcessStatus(status).value
        body = {"host_name": self.ctx.host_name, "role": self.role, "status": status, "attempt": self.attempt,
                **fields}
        _retrying(self.api.report_host_process, self.run_id, self.index,
                  deadline_s=self.ctx.report_deadline_s if final else 30.0, what=f"report {status}", **body)

    def _run_now(self) -> dict[str, Any] | None:
        try:
            return self.api.get_run(self.run_id)
        except (httpx.TransportError, ApiClientError) as exc:
            if isinstance(exc, ApiClientError) and exc.status == 404:
                return {"status": "DELETED", "attempt": -1}
            return None  # unknown for now; keep running

    # --- the task ---------------------------------------------------------------------------------

    def run(self) -> str:
        run = _retrying(self.api.get_run, self.run_id, deadline_s=30.0, what="read run")
        if run["attempt"] != self.attempt or run["status"] != RunStatus.STARTING:
            log.info("run %s attempt %s is stale (now attempt %s, %s); not starting", self.run_id, self.attempt,
                     run["attempt"], run["status"])
            return "stale"
        mine = next((row for row in self.api.list_run_hosts(self.run_id, self.attempt)
                     if row["process_index"] == self.index), None)
        if mine is None or mine["host_name"] != self.ctx.host_name or mine["pid"] is not None:
            return "duplicate"  # a resent message for a process that is already started (or not ours)
        spec = RunSpec.model_validate({**run["spec"], "output_dir": str(self.out)})
        refusal = self.check_run_directory(run) or check_write_paths(run["spec"]) or self.check_process(spec)
        if refusal is not None:
            self.report(HostProcessStatus.FAILED, final=True, reason=refusal, exit_code=None, ended_at=now_utc().isoformat())
            return "refused"
        write_run_marker(self.out, self.run_id)
        self.cancel_file.unlink(missing_ok=True)
        spec_path = self.control / f"spec-attempt{self.attempt}-host{self.index}.yaml"
        spec_path.write_text(dump_spec(spec), encoding="utf-8")
        if self.secret:
            write_private(self.secret_file, self.secret)

        coordinator = None
        if self.num_processes > 1:
            coordinator = self._coordinator()
            if coordinator is None:
                return "stale"
        command = self.command(spec, spec_path, coordinator)
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=self.ctx.engine_env or engine_environment({}), start_new_session=True, preexec_fn=_die_with_parent,
        )
        try:
            self.report(HostProcessStatus.RUNNING, pid=self.process.pid, started_at=now_utc().isoformat())
        except ApiClientError as exc:
            if not is_stale_refusal(exc):
                raise
            log.info("run %s attempt %s moved on while starting; stopping host process %s", self.run_id,
                     self.attempt, self.index)  # supervise() sees the run moved on and stops it
        log.info("run %s attempt %s: host process %s started (pid %s)", self.run_id, self.attempt, self.index,
                 self.process.pid)
        return self.supervise(spec)

    def check_run_directory(self, run: Mapping[str, Any]) -> str | None:
        """The host's own check before anything is written (the message could be forged or the API
        misconfigured): the directory must be `<runs_root>/<id>-<name>` with symlinks resolved, and must
        not belong to another run (its `.control/run-id` marker). Returns why not, or None."""
        root = self.ctx.runs_root.resolve()
        expected = root / run_dir_name(self.run_id, run['name'])
        real = self.out.resolve()
        if real != expected or real.parent != root:
            return f"run directory {self.out} is not {expected} (this host writes only under {root})"
        try:
            owner = read_run_marker(real)
        except OSError as exc:
            return f"run directory {real} is unreadable: {exc}"
        if owner is not None and owner != str(self.run_id):
            return f"run directory {real} belongs to run {owner}"
        return None

    def _coordinator(self) -> str | None:
        """Process 0 picks a free port and publishes ADDR:PORT; the others wait for it."""
        if self.index == 0:
            from locojax.launch import free_port

            address = f"{self.ctx.address}:{free_port()}"
            self.report(HostProcessStatus.STARTING, address=address)
            return address
        while True:
            rows = _retrying(self.api.list_run_hosts, self.run_id, self.attempt, deadline_s=30.0,
                             what="read coordinator")
            first = next((row for row in rows if row["process_index"] == 0), None)
            if first is not None and first["address"]:
                return first["address"]
            run = self._run_now()
            if run is not None and (run["attempt"] != self.attempt or run["status"] != RunStatus.STARTING):
                return None
            time.sleep(0.2)

    def command(self, spec: RunSpec, spec_path: Path, coordinator: str | None) -> list[str]:
        """This process's command line, as the run's mode lays it out for its role."""
        start = EngineStart(
            spec_path=str(spec_path), role=self.role, process_index=self.index, num_processes=self.num_processes,
            devices_per_host=spec.placement.devices_per_host, cancel_file=str(self.cancel_file),
            coordinator=coordinator, resume=self.resume, reward_modules=self.ctx.reward_modules,
            secret_file=str(self.secret_file) if self.secret else None, ray_address=self.ctx.ray_address,
            node_address=self.ctx.address, compilation_cache=self.ctx.compilation_cache)
        return [sys.executable, "-m", "locojax.cli", *spec_mode(spec).command(start)]

    def check_process(self, spec: RunSpec) -> str | None:
        """The host's own check that the message names a process of its run's layout, in that process's
        role (the role decides the command line). Returns why not, or None."""
        roles = spec_mode(spec).layout(spec.placement).roles
        if self.num_processes != len(roles) or not 0 <= self.index < len(roles) or roles[self.index] != self.role:
            return (f"process {self.index} of {self.num_processes} in role {self.role!r} is not in this run's layout "
                    f"(its processes' roles: {', '.join(roles)})")
        return None

    def supervise(self, spec: RunSpec) -> str:
        assert self.process is not None and self.process.stdout is not None
        output = OutputRelay(self.api, self.run_id, f"host{self.index}", self.attempt * EVENT_SEQ_PER_ATTEMPT,
                             self.process.stdout, attempt=self.attempt, host_name=self.ctx.host_name)
        metrics = (MetricsRelay(self.api, self.run_id, self.out / METRICS_FILE, attempt=self.attempt,
                                host_name=self.ctx.host_name) if self.index == METRICS_PROCESS_INDEX else None)
        checkpoint_dir = self.out / CHECKPOINTS_DIR  # `run` refused a spec naming another (check_write_paths)
        reported_checkpoint: int | None = None
        cancel_at: float | None = None
        stop_reason: str | None = None  # set when the supervisor stops the process on purpose
        term_at: float | None = None
        last_poll = 0.0
        while True:
            returncode = self.process.poll()
            output.collect()
            output.flush()
            if metrics is not None:
                metrics.read()
                metrics.flush()
                reported_checkpoint = self._report_checkpoint(checkpoint_dir, reported_checkpoint)
            if returncode is not None:
                break
            now = time.monotonic()
            if stop_reason is None and (output.stale or (metrics is not None and metrics.stale)):
                # The API refused this attempt's reports: a newer attempt owns the run (or it ended).
                stop_reason = "the API refused its reports as stale (a newer attempt or a finished run)"
                term_at = now
            if now - last_poll >= 1.0:
                last_poll = now
                run = self._run_now()
                if run is not None and stop_reason is None:
                    if run["attempt"] != self.attempt or run["status"] in MOVED_ON:
                        stop_reason = f"the run moved on ({run['status']}, attempt {run['attempt']})"
                        term_at = now
                    elif run["status"] == RunStatus.CANCELLING and cancel_at is None:
                        self.cancel_file.touch()
                        cancel_at = now
                        log.info("run %s: cancel requested; waiting for the step boundary", self.run_id)
                if cancel_at is not None and term_at is None and now - cancel_at >= self.ctx.cancel_grace_s:
                    stop_reason = f"did not stop within {self.ctx.cancel_grace_s:g} s of the cancel request"
                    term_at = now
            if term_at is not None:
                self._stop(term_at)
            time.sleep(self.ctx.poll_s)

        # Whatever the engine started in its session and left behind when it ended (a Ray agent whose
        # raylet died with a killed driver) goes with it: nothing of an attempt outlives its process.
        self._sweep_session()
        output.thread.join(timeout=5)
        output.collect()
        def delivered() -> bool:
            if metrics is not None:
                metrics.read()
                if not metrics.flush():
                    return False
            return output.flush()

        deadline = time.monotonic() + self.ctx.report_deadline_s
        # The last metrics (and the last checkpoint) land before the exit report that may end the run.
        while not delivered():
            if time.monotonic() > deadline:
                log.error("run %s: gave up delivering %d metric rows", self.run_id,
                          len(metrics.pending) if metrics else 0)
                break
            time.sleep(1.0)
        if metrics is not None:
            self._report_checkpoint(checkpoint_dir, reported_checkpoint)
        return self._report_exit(returncode, stop_reason, output.tail)

    def _stop(self, term_at: float) -> None:
        """SIGTERM the process group, then SIGKILL it `term_grace_s` later."""
        assert self.process is not None
        signum = signal.SIGTERM if time.monotonic() - term_at < self.ctx.term_grace_s else signal.SIGKILL
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def _sweep_session(self) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own process group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass  # nothing was left

    def _report_checkpoint(self, directory: Path, reported: int | None) -> int | None:
        try:
            steps = [int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
        except FileNotFoundError:
            return reported
        latest = max(steps, default=None)
        if latest is not None and (reported is None or latest > reported):
            try:
                self.api.report_checkpoint(self.run_id, latest, attempt=self.attempt, host_name=self.ctx.host_name)
                return latest
            except (httpx.TransportError, ApiClientError):
                return reported
        return reported

    def _report_exit(self, returncode: int, stop_reason: str | None, tail: list[str]) -> str:
        self.secret_file.unlink(missing_ok=True)
        fields: dict[str, Any] = {"exit_code": returncode, "ended_at": now_utc().isoformat()}
        if returncode == EXIT_OK:
            status, reason = HostProcessStatus.EXITED, "exited cleanly"
        elif returncode == EXIT_CANCELLED:
            status, reason = HostProcessStatus.EXITED, "stopped at a step boundary on a cancel request"
        elif stop_reason is not None:
            status, reason = HostProcessStatus.KILLED, f"stopped by its worker: {stop_reason}"
        else:
            status = HostProcessStatus.FAILED
            cause = (f"killed by {signal.Signals(-returncode).name}" if returncode < 0
                     else f"exit code {returncode}")
            where = self._last_phase()
            reason = cause + (f" {where}" if where else "") + (f"; last output: {tail[-1][:500]}" if tail else "")
        self.report(status, final=True, reason=reason, **fields)
        log.info("run %s attempt %s: host process %s %s (%s)", self.run_id, self.attempt, self.index, status.value,
                 reason)
        return status.value.lower()

    def _last_phase(self) -> str:
        state = read_host_status(self.out, self.index)
        return f"in phase {state['phase']} of step {state['step']}" if state and "phase" in state else ""
