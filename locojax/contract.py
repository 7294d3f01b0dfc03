"""The light contract every part of LoCoJAX shares: engine, server, worker and web import it, and it
imports nothing heavy (no JAX, no numpy; a test checks `import locojax.contract` leaves `jax` out of
`sys.modules`).

It holds
  * the per-step metric names of DESIGN §6, each defined once with its meaning and how it aggregates
    across hosts (the timers and reporters that produce them live in `locojax.metrics`);
  * the run statuses of the control plane (DESIGN §7) and the engine's own end states;
  * the exit codes of `locojax train` / `locojax host`;
  * the run-directory layout (`spec.yaml`, `metrics.jsonl`, `environment.json`, `tensorboard/`,
    `hosts/host<i>.json`, `result.json`, `checkpoints/`, SFT's `model/`) with its readers and writers;
  * the message shapes the scheduler sends and the worker consumes, the task's name and each host's queue.

Records are flat: `{"step": 3, "host": 0, "time/step": 0.41, "reward/mean": 0.2, ...}`; `step` is
the 0-based index of the step the values describe (after it, `TrainState.step == step + 1`), `host`
the process index, or "all" for the aggregate over hosts.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Literal, Mapping

# ================================================================================================
# Metric names

Aggregation = Literal["mean", "max", "sum", "min", "ratio"]
Split = Literal["device", "network"]
Host = int | str  # a process index, or ALL_HOSTS for the aggregate
ALL_HOSTS = "all"
# The control plane stores the aggregate's rows under this host index (0..N-1 are process indices):
# an int keeps its primary key narrow and typed the same on every database backend.
AGGREGATE_HOST_INDEX = -1


def host_index(host: Host) -> int:
    """A record's `host` as the control plane stores it: the process index, or AGGREGATE_HOST_INDEX."""
    return AGGREGATE_HOST_INDEX if host == ALL_HOSTS else int(host)


@dataclasses.dataclass(frozen=True)
class MetricInfo:
    name: str
    unit: str
    across_hosts: Aggregation
    description: str


METRICS: dict[str, MetricInfo] = {}
# A "ratio" metric's (numerator, denominator) metric names: across hosts it is sum(numerator) /
# sum(denominator), so H hosts report exactly what one host would on the same items.
RATIO_PARTS: dict[str, tuple[str, str]] = {}


def _define(name: str, unit: str, across_hosts: Aggregation, description: str) -> str:
    METRICS[name] = MetricInfo(name, unit, across_hosts, description)
    return name


# --- time: wall seconds per step. Phases may nest inside others; they are not a partition. -------
# A synchronous step is as slow as its slowest host, hence max for time/step; phase times are means.
TIME_STEP = _define("time/step", "s", "max", "wall time of the whole step on this host")
TIME_ROLLOUT = _define("time/rollout", "s", "mean", "prompt sharding, prefill and decode, incl. detokenisation")
TIME_REWARD = _define("time/reward", "s", "mean", "reward scoring on the host CPU")
TIME_ADVANTAGE = _define("time/advantage", "s", "mean", "group-normalised advantages")
TIME_TRAIN = _define("time/train", "s", "mean", "global batch assembly and the train step (incl. its all-reduce)")
TIME_WEIGHT_SYNC = _define("time/weight_sync", "s", "mean", "DA: pushing new weights to rollout hosts")
TIME_CHECKPOINT = _define("time/checkpoint", "s", "mean", "blocking part of a checkpoint save")
# Only on the first step a process runs: what came before its loop (devices opened, memory plan and the
# programs it compiles, model built or restored). Startup cost = this + that step's time/step.
TIME_SETUP = _define("time/setup", "s", "max", "first step only: the mode's setup before the run loop")
# Where time/setup went, for the modes that train in the run loop's process (CO, SFT): compiling the
# run's programs ahead of the first step (the compiled memory plan, on accelerators; 0 on CPU, where they
# compile in step 0), and building the policy and its optimizer state on the mesh (or restoring them).
TIME_SETUP_COMPILE = _define("time/setup_compile", "s", "max",
                             "first step only: of time/setup, lowering and compiling the run's programs")
TIME_SETUP_MODEL = _define("time/setup_model", "s", "max",
                           "first step only: of time/setup, the policy, its train state on the mesh, a restore")
# And the JAX backend's start-up when the session is the first to touch it: on a TPU, opening the chip
# (its runtime's start, seconds), which no later run of the same process pays again.
TIME_SETUP_BACKEND = _define("time/setup_backend", "s", "max",
                             "first step only: of time/setup, starting the JAX backend (opening the chips)")
SETUP_PARTS = (TIME_SETUP_BACKEND, TIME_SETUP_COMPILE, TIME_SETUP_MODEL)
# The paper's split; see `split_step_time` for the definition.
TIME_DEVICE = _define("time/device", "s", "mean", "devices busy: device computations timed up to block_until_ready")
TIME_NETWORK = _define("time/network", "s", "mean", "collectives and weight transfers timed on their own")
TIME_HOST = _define("time/host", "s", "mean", "step minus device minus network: host orchestration while devices wait")

# --- throughput: each host's tokens over the same synchronous step, so the global rate is the sum.
THROUGHPUT_ROLLOUT_TOKENS = _define(
    "throughput/rollout_tokens_per_s", "tokens/s", "sum", "generated completion tokens / time/rollout")
THROUGHPUT_TRAIN_TOKENS = _define(
    "throughput/train_tokens_per_s", "tokens/s", "sum", "prompt+completion tokens trained / time/train")

# --- memory: where the runtime reports it (accelerators; XLA:CPU reports nothing, so CPU runs carry none).
MEMORY_DEVICE_PEAK = _define(
    "memory/device_peak_gib", "GiB", "max",
    "highest peak of this host's devices since the engine started (the allocator's peak_bytes_in_use plus the "
    "runtime's peak_bytes_reserved for programs' temporaries, on a TPU), to set beside the memory plan")

# --- rewards: every host scores equally many samples, so the mean of host means is the global
# mean; reward/std aggregated as a mean of host stds is an approximation (it omits the spread
# between host means).
REWARD_MEAN = _define("reward/mean", "", "mean", "mean total reward over the step's samples")
REWARD_STD = _define("reward/std", "", "mean", "std of total reward over the step's samples (ddof=0)")
REWARD_FRAC_ZERO_STD = _define(
    "reward/frac_zero_std", "", "mean", "fraction of groups whose rewards are all equal (zero advantage)")
REWARD_FN_MEAN_PATTERN = "reward/{fn}/mean"  # per reward function; aggregated as a mean


def reward_fn_mean(fn: str) -> str:
    """`reward/<fn>/mean`: the mean of one reward function's scores."""
    return REWARD_FN_MEAN_PATTERN.format(fn=fn)


# --- train step outputs: one SPMD step computes them over the global batch, so hosts agree.
LOSS_POLICY = _define("loss/policy", "", "mean", "clipped surrogate loss under the chosen aggregation")
LOSS_KL = _define("loss/kl", "", "mean", "k3 KL to the reference policy under the chosen aggregation (before kl_coef)")
LOSS_TOTAL = _define("loss/total", "", "mean", "loss/policy + kl_coef * loss/kl")
LOSS_SFT = _define("loss/sft", "nats", "mean", "teacher-forced cross-entropy per completion token")
POLICY_ENTROPY = _define("policy/entropy", "nats", "mean", "token-mean entropy of the trained policy (at temperature)")
POLICY_CLIP_FRAC = _define(
    "policy/clip_frac", "", "mean", "fraction of completion tokens whose gradient the ratio clip zeroed")
POLICY_GRAD_NORM = _define("policy/grad_norm", "", "mean", "global gradient norm before clipping")
OPTIM_LR = _define("optim/lr", "", "mean", "learning rate of this step's update(s)")

# --- completions
COMPLETION_LEN_MEAN = _define("completion/len_mean", "tokens", "mean", "mean completion length incl. EOS")
COMPLETION_LEN_MAX = _define("completion/len_max", "tokens", "max", "longest completion")
COMPLETION_CLIPPED_FRAC = _define(
    "completion/clipped_frac", "", "mean", "fraction of completions cut at max_new_tokens without EOS")

# --- SC only
SC_WORKER_SAMPLE = _define("sc/worker_sample", "s", "max",
                           "SC: a worker's sampling of its host's prompts, as the worker measured it")
SC_WORKER_TRAIN = _define("sc/worker_train", "s", "max",
                          "SC: a worker's part of the train step (incl. its all-reduce), as it measured it")

# --- DA only
DA_STALENESS = _define("da/staleness", "steps", "max", "policy versions between sampling and training (<= 1)")
DA_ROLLOUT_IDLE = _define("da/rollout_idle", "s", "mean", "rollout hosts waiting for new weights")
DA_WEIGHT_SYNC_BYTES = _define("da/weight_sync_bytes", "bytes", "max",
                               "DA: bytes pushed to each rollout host at a weight sync (LoRA: the adapters alone)")
DA_TRAIN_IDLE = _define("da/train_idle", "s", "mean", "train hosts waiting for a rollout batch")


# --- held-out evaluation (locojax.evaluate). Hosts evaluate disjoint shards of the held-out prompts;
# their counts are summed and the ratios recomputed from the sums, never averaged. Recorded in step
# t's record they describe the policy step t started from (t updates applied); the evaluation after
# the last step is a record of its own at step = steps.
EVAL_PROMPTS = _define("eval/prompts", "prompts", "sum", "held-out prompts evaluated")
EVAL_CORRECT = _define("eval/correct", "prompts", "sum", "held-out prompts the greedy completion answers right")
EVAL_PASS_CORRECT = _define(
    "eval/pass@k_correct", "prompts", "sum", "held-out prompts with a right answer among the k attempts")
EVAL_ACCURACY = _define("eval/accuracy", "", "ratio", "eval/correct / eval/prompts: greedy accuracy")
EVAL_PASS_AT_K = _define(
    "eval/pass@k", "", "ratio", "eval/pass@k_correct / eval/prompts: right in at least one of k attempts "
    "(the greedy completion and k-1 samples at eval.temperature)")
EVAL_TIME = _define("time/eval", "s", "max", "wall time of one evaluation (outside time/step)")
RATIO_PARTS[EVAL_ACCURACY] = (EVAL_CORRECT, EVAL_PROMPTS)
RATIO_PARTS[EVAL_PASS_AT_K] = (EVAL_PASS_CORRECT, EVAL_PROMPTS)


def across_hosts(name: str) -> Aggregation:
    """How metric `name` aggregates across hosts; unknown names (e.g. reward/<fn>/mean) use the mean."""
    info = METRICS.get(name)
    return info.across_hosts if info else "mean"



# Debug and control values that travel in a step's record (not DESIGN §6 metrics).
CHECKSUM_KEY = "params/checksum"  # a host's parameter fingerprint, only when spec.debug asks for it
CANCEL_KEY = "control/cancel"  # the cancel vote of one host; the loop pops it before logging
DA_ROLLOUT_CHECKSUM = "da/rollout_checksum"  # the weights a DA batch was sampled with
DA_ROLLOUT_VERSION = "da/rollout_version"


# ================================================================================================
# Run statuses and exit codes


class RunStatus(str, enum.Enum):
    """A run's state in the control plane (DESIGN §7); transitions live in server/services/runs.py."""

    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CANCELLING = "CANCELLING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


class HostProcessStatus(str, enum.Enum):
    """One engine process of a run, as its worker reports it."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    EXITED = "EXITED"  # exit code 0, or EXIT_CANCELLED after a cooperative cancel
    FAILED = "FAILED"  # non-zero exit code or signal
    KILLED = "KILLED"  # stopped on purpose (cancel, recovery of the group)
    LOST = "LOST"  # its host stopped heartbeating


class EngineStatus(str, enum.Enum):
    """How an engine run ended (`result.json`'s status): every step done, or stopped at a step
    boundary after a cooperative cancel. A failure raises instead and writes no result."""

    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"


def validation_message(error: Mapping[str, Any]) -> str:
    """What a person reads for one pydantic validation error (an item of `ValidationError.errors()`): its
    message without the "Value error, " pydantic puts before a validator's own, so the CLI, the REST API
    and the placement commands word a refusal alike."""
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")


EXIT_OK = 0
EXIT_FAILED = 1  # a host failed (e.g. a DA actor died); the message names it
EXIT_SPEC_ERROR = 2  # refused before anything ran: a bad spec, option or input; the message says why
EXIT_CANCELLED = 3  # `locojax train`/`host` after a cooperative cancel
EXIT_UNREACHABLE = 4  # the client (`locojax submit`, `status`, ...) could not reach the server


# ================================================================================================
# The run directory


SPEC_FILE = "spec.yaml"
METRICS_FILE = "metrics.jsonl"  # host 0 writes every host's records and the "all" aggregate
# The process that writes METRICS_FILE, in every mode and role (CO, an SC controller, a DA driver, SFT):
# its host alone relays the run's metrics (and checkpoints), and the control plane takes metrics from no other.
METRICS_PROCESS_INDEX = 0
RESULT_FILE = "result.json"
# What the run ran on and what it trained, written by host 0 at start (`EngineEnvironment`): a run
# directory carried off a machine without the control plane (a TPU VM) says which hardware it measured.
ENVIRONMENT_FILE = "environment.json"
# TensorBoard event files: one directory per host (`host<i>`) and one for the aggregate (`all`).
TENSORBOARD_DIR = "tensorboard"
HOSTS_DIR = "hosts"  # hosts/host<i>.json: where host i is (step, phase, pid)
CHECKPOINTS_DIR = "checkpoints"  # Orbax, unless spec.checkpoint.dir names another place
EXPORT_DIR = "model"  # an SFT run's Hugging Face export, what a GRPO spec's model.checkpoint names
ADAPTER_DIR = "adapter"  # a LoRA run's export: its adapters alone, in PEFT's format (beside EXPORT_DIR)
CONTROL_DIR = ".control"  # the workers' files: start specs, cancel flags, the run-id marker
RUN_MARKER = "run-id"  # .control/run-id: which run owns this directory (a reused id or name must not share it)


def run_dir_name(run_id: int, name: str) -> str:
    """The directory a control-plane run writes to under the runs root: `<id>-<name>` (one per run
    id, since two runs may share a name)."""
    return f"{run_id}-{name}"


def write_run_marker(out: Path, run_id: int) -> None:
    """Claim `out` for `run_id`. Every host process of a run may write it at once (they can share one
    file system), and a host checks it before it writes anything, so the write is atomic: a reader sees
    the old marker or the new one, never an empty file."""
    control = out / CONTROL_DIR
    control.mkdir(parents=True, exist_ok=True)
    tmp = control / f"{RUN_MARKER}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    tmp.write_text(str(run_id), encoding="utf-8")
    tmp.replace(control / RUN_MARKER)


def read_run_marker(out: Path) -> str | None:
    """The run id that claimed `out`, or None when no run has (OSError other than a missing file is
    the caller's to report)."""
    try:
        return (out / CONTROL_DIR / RUN_MARKER).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None


@dataclasses.dataclass
class RunResult:
    status: str  # an EngineStatus value
    steps_done: int
    last_checkpoint_step: int | None
    final_metrics: dict[str, float]
    checkpoint_bytes: int | None = None  # size on disk of the last checkpoint (LoRA: adapters alone)


def write_result(out: Path, result: RunResult) -> None:
    (out / RESULT_FILE).write_text(json.dumps(dataclasses.asdict(result), indent=2), encoding="utf-8")


def read_result(out: Path) -> RunResult | None:
    try:
        return RunResult(**json.loads((out / RESULT_FILE).read_text(encoding="utf-8")))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


@dataclasses.dataclass(frozen=True)
class EngineEnvironment:
    """What a run ran on and what it trained, as its host 0 saw them at start (`environment.json`).

    `device_kind` is JAX's own name ("TPU v5 lite", "cpu"); `hardware` the placement catalog's profile
    it maps to (`locojax.placement.hardware.hardware_for_device`), None when the catalog has none.
    `model` holds the `ModelConfig` fields of the model the run trains (a checkpoint's own dimensions,
    not the spec's preset name), so the cost model can price it without the checkpoint.
    """

    platform: str
    device_kind: str
    hardware: str | None
    devices: int  # over every process of the run
    local_devices: int
    processes: int
    device_memory_bytes: int | None  # one device's allocator limit, where the runtime reports it
    model: dict[str, Any]
    jax_version: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = ENVIRONMENT_FILE) -> "EngineEnvironment":
        """Checked field by field: a file carried from another machine is input like any other."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a JSON object")
        fields = {field.name: field for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        types = {"platform": str, "device_kind": str, "hardware": (str, type(None)), "devices": int,
                 "local_devices": int, "processes": int, "device_memory_bytes": (int, type(None)), "model": dict,
                 "jax_version": str}
        for name, expected in types.items():
            if name not in data:
                if fields[name].default is dataclasses.MISSING:
                    raise ValueError(f"{where}: field {name!r} is missing")
                continue
            value = data[name]
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
        for name in ("devices", "local_devices", "processes"):
            if data[name] < 1:
                raise ValueError(f"{where}: field {name!r} must be at least 1, got {data[name]}")
        return cls(**dict(data))


def write_environment(out: Path, environment: EngineEnvironment) -> None:
    (out / ENVIRONMENT_FILE).write_text(json.dumps(environment.to_json(), indent=2), encoding="utf-8")


def read_environment(out: Path) -> EngineEnvironment | None:
    """The run's environment, or None when it has no `environment.json` (runs from before it existed);
    a malformed file is a ValueError naming it."""
    path = out / ENVIRONMENT_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg})") from None
    return EngineEnvironment.from_json(data, str(path))


def host_status_path(out: Path, host: int) -> Path:
    return out / HOSTS_DIR / f"host{host}.json"


class HostStatus:
    """Where this host is (step, phase), in `<output_dir>/hosts/host<i>.json`, so that when a host
    dies or hangs the launcher or worker can say in which phase it was lost.

    A background thread writes the file: calling the status only records the newest (step, phase),
    because each atomic write (a file and a rename) cost about a millisecond on a TPU VM, five times a
    step, while the chip waited. The thread writes a status once it has stood `settle_s`: a write
    takes and drops the GIL at every system call, and one started while the run loop scored a step's
    rewards or dispatched its update slowed that Python by ~0.6 ms (1.3 ms of work here), on the
    chip's critical path. Short phases are then left out, and the long ones (a rollout the host
    waits on, a hang) are written while the run loop waits; a status changing faster than that is
    still written within `max_delay_s`. A host that dies leaves a phase that trails it by at most
    `max_delay_s` plus the write in flight. `close` writes the newest status at once."""

    def __init__(self, out: Path, host: int, *, settle_s: float = 0.01, max_delay_s: float = 0.25):
        self.host = host
        self.path = host_status_path(out, host)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.settle_s, self.max_delay_s = settle_s, max_delay_s
        self._changed = threading.Condition()
        self._latest: tuple[int, str] | None = None
        self._written: tuple[int, str] | None = None
        self._closed = False
        self._settling = False
        self._writer = threading.Thread(target=self._write_changes, name=f"host-status-{host}", daemon=True)
        self._writer.start()

    def __call__(self, step: int, phase: str) -> None:
        with self._changed:
            self._latest = (step, phase)
            if not self._settling:  # a settling writer looks again by itself: waking it costs the GIL too
                self._changed.notify_all()

    def _settled(self) -> None:
        """Wait (holding `_changed`) until the newest status has stood `settle_s`, the oldest unwritten
        one has waited `max_delay_s`, or the status is closed."""
        deadline = time.monotonic() + self.max_delay_s
        self._settling = True
        try:
            while not self._closed:
                left = deadline - time.monotonic()
                seen = self._latest
                if left <= 0 or not self._changed.wait_for(lambda: self._latest != seen or self._closed,
                                                            timeout=min(self.settle_s, left)):
                    return
        finally:
            self._settling = False

    def _write_changes(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._latest != self._written or self._closed)
                self._settled()
                latest = self._latest
                if latest == self._written:
                    return  # closed with nothing left to write
            step, phase = latest
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"host": self.host, "step": step, "phase": phase, "pid": os.getpid()}))
            tmp.replace(self.path)  # atomic: a reader never sees half a file
            with self._changed:
                self._written = latest
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._writer.join()


def read_host_status(out: Path, host: int) -> dict | None:
    try:
        return json.loads(host_status_path(out, host).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def cancel_requested(cancel_file: str | Path | None) -> bool:
    return cancel_file is not None and Path(cancel_file).exists()


def _json_value(value: Any) -> Any:
    value = float(value)
    return value if math.isfinite(value) else None  # JSON has no NaN/inf


class JsonlSink:
    """One flat JSON object per line: {"step": 3, "host": 0, "time/step": ..., ...}; non-finite
    values are written as null. The placement calibration and the worker's relay read this format."""

    def __init__(self, path: str | Path, *, append: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w", encoding="utf-8")

    def write(self, step: int, host: Host, metrics: Mapping[str, float]) -> None:
        record = {"step": int(step), "host": host, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()  # a killed run keeps every finished step

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ================================================================================================
# Worker messages


# The Celery task that starts one engine process; the scheduler sends it (server.scheduler builds its
# sending client from these names) and the host workers run it (worker.app builds their Celery app).
START_HOST_TASK = "locojax.start_host"
MESSAGE_SERIALIZER = "json"  # the task messages' body format, on both sides


def host_queue(host_name: str) -> str:
    """Each host consumes only its own queue, so a start message reaches exactly the host it names."""
    return f"host.{host_name}"


@dataclasses.dataclass(frozen=True)
class StartHostMessage:
    """One `start_host` task for one host's queue. The worker re-reads the run from the API (tasks take
    ids); the message carries only what the scheduler decided."""

    host_name: str
    run_id: int
    attempt: int
    process_index: int
    num_processes: int
    role: str
    resume: bool
    output_dir: str
    # The attempt's shared secret: what its processes authenticate each other with over the network
    # (SC's controller link, DA's Ray token). New for every attempt; never shown by the API.
    secret: str = ""

    def task_kwargs(self) -> dict[str, Any]:
        """The task's keyword arguments: everything but the queue it travels on."""
        return {key: value for key, value in dataclasses.asdict(self).items() if key != "host_name"}
