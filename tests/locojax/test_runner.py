"""The one run loop (locojax.runner) with a mode whose step is plain arithmetic, and the on-device
parameter checksum the modes report only when a spec asks for it."""

from __future__ import annotations

import gc
import json
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from locojax import metrics as m
from locojax.contract import CHECKSUM_KEY, METRICS_FILE, RESULT_FILE, HostStatus, read_host_status
from locojax.modes.common import params_checksum
from locojax.runner import ModeSession, StepOutput, checksum_due, run
from locojax.spec import parse_spec


class CountingSession(ModeSession):
    """A mode of its own: each step "trains" 10 tokens and reports its step number; it cancels itself
    (through the cancel file) at `cancel_at`, and evaluates before step 0 and after the last step."""

    def __init__(self, spec, *, resume=False, cancel_file=None, cancel_at=None, last_step_ignores_cancel=False):
        self.spec, self.cancel_file, self.cancel_at = spec, cancel_file, cancel_at
        self.last_step_ignores_cancel = last_step_ignores_cancel
        self.saves: list[bool] = []
        self.steps_logged_at_save: list[list[int]] = []
        self.finished = self.closed = False

    def step(self, step, timer, where):
        with timer.phase(m.TIME_TRAIN):
            where(step, "train")
        if step == self.cancel_at:
            self.cancel_file.touch()
        return StepOutput({m.LOSS_POLICY: jnp.float32(step)}, train_tokens=10)

    def checkpoint(self, force):
        self.saves.append(force)
        metrics = Path(self.spec.output_dir) / METRICS_FILE
        rows = m.read_jsonl(metrics) if metrics.exists() else []
        self.steps_logged_at_save.append(sorted({r["step"] for r in rows if r["host"] == m.ALL_HOSTS}))

    def evaluate(self, step, where):
        return {m.EVAL_PROMPTS: 4.0, m.EVAL_CORRECT: 1.0} if step == 0 else {}

    def final_evaluation(self, where):
        return {m.EVAL_PROMPTS: 4.0, m.EVAL_CORRECT: 3.0}

    def finish(self, status, steps_done, where):
        self.finished = True
        return steps_done

    def close(self):
        self.closed = True


def _run(tmp_path, steps, **session_options):
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = parse_spec({"name": "counting", "steps": steps, "output_dir": str(tmp_path / "out")})
    cancel_file = tmp_path / "cancel"
    sessions = []

    def setup(spec, *, resume):
        sessions.append(CountingSession(spec, resume=resume, cancel_file=cancel_file, **session_options))
        return sessions[0]

    return run(spec, setup, console=False, cancel_file=cancel_file), sessions[0], tmp_path / "out"


def test_the_loop_logs_each_step_evaluates_and_finishes(tmp_path):
    result, session, out = _run(tmp_path, 3)
    assert (result.status, result.steps_done, result.last_checkpoint_step) == ("succeeded", 3, 3)
    assert session.saves == [False, False, True] and session.finished and session.closed
    rows = [r for r in m.read_jsonl(out / METRICS_FILE) if r["host"] == m.ALL_HOSTS]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the final evaluation is a record at step = steps
    assert [r.get(m.LOSS_POLICY) for r in rows[:3]] == [0.0, 1.0, 2.0]
    assert rows[0][m.EVAL_CORRECT] == 1.0 and m.EVAL_CORRECT not in rows[1] and rows[3][m.EVAL_CORRECT] == 3.0
    for row in rows[:3]:
        assert row[m.TIME_STEP] >= row[m.TIME_TRAIN] >= 0 and "control/cancel" not in row
        assert row[m.THROUGHPUT_TRAIN_TOKENS] == (10 / row[m.TIME_TRAIN] if row[m.TIME_TRAIN] else 0.0)
    assert json.loads((out / RESULT_FILE).read_text())["status"] == "succeeded"
    assert read_host_status(out, 0)["phase"] == "metrics"


class CyclesSession(CountingSession):
    """Each step leaves a reference cycle behind (garbage only the cyclic collector frees) and notes
    whether automatic collection was on during it and whether the previous step's cycle was gone."""

    def __init__(self, spec, **options):
        super().__init__(spec, **options)
        self.collecting_during_step: list[bool] = []
        self.previous_cycle_freed: list[bool] = []
        self.last_cycle = None

    def step(self, step, timer, where):
        self.collecting_during_step.append(gc.isenabled())
        if self.last_cycle is not None:
            self.previous_cycle_freed.append(self.last_cycle() is None)
        cycle = type("Node", (), {})()
        cycle.self = cycle
        self.last_cycle = weakref.ref(cycle)
        del cycle
        return super().step(step, timer, where)


def test_cyclic_garbage_is_collected_between_steps_not_during_them(tmp_path):
    """The loop runs Python's cyclic collector after each step and nowhere inside one, freezes what
    the first step leaves (never traversed again), and leaves the collector as it found it."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    spec = parse_spec({"name": "cycles", "steps": 4, "output_dir": str(tmp_path / "out")})
    sessions = []
    result = run(spec, lambda spec, *, resume: sessions.append(CyclesSession(spec)) or sessions[0], console=False)
    assert result.status == "succeeded"
    session = sessions[0]
    assert session.collecting_during_step == [False] * 4
    assert session.previous_cycle_freed == [True] * 3  # each step's cycle was gone when the next began
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:  # a loop that starts with collection off leaves it off
        assert run(parse_spec({"name": "off", "steps": 2, "output_dir": str(tmp_path / "off")}),
                   lambda spec, *, resume: CountingSession(spec), console=False).status == "succeeded"
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def _watch_status(out, until, timeout_s=10.0):
    """Every phase the status file showed, polled until `until(status)` holds (or the timeout)."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_host_status(out, 0)
        if status and (not seen or seen[-1] != (status["step"], status["phase"])):
            seen.append((status["step"], status["phase"]))
        if status and until(status):
            break
        time.sleep(0.002)
    return seen


def test_the_host_status_writes_the_phases_that_last_and_skips_the_fleeting_ones(tmp_path):
    """A phase that stands `settle_s` is written while the host is still in it; one replaced sooner is
    never written; phases that change faster than `settle_s` for longer than `max_delay_s` are still
    written; `close` writes the newest at once."""
    where = HostStatus(tmp_path, 0, settle_s=0.3, max_delay_s=60.0)
    try:
        where(1, "reward")
        where(1, "train")  # replaced at once: never on disk
        assert _watch_status(tmp_path, lambda s: s["phase"] == "train") == [(1, "train")]
        where(2, "rollout")
        assert _watch_status(tmp_path, lambda s: s["step"] == 2)[-1] == (2, "rollout")
    finally:
        where.close()
    churning = HostStatus(tmp_path / "churn", 0, settle_s=60.0, max_delay_s=0.2)
    try:
        started = time.monotonic()
        step = 0
        while read_host_status(tmp_path / "churn", 0) is None and time.monotonic() - started < 10:
            step += 1
            churning(step, "rollout")
            time.sleep(0.001)
        assert read_host_status(tmp_path / "churn", 0) is not None  # written although it never settled
        churning(step + 1, "metrics")
    finally:
        churning.close()
    assert read_host_status(tmp_path / "churn", 0) == {"host": 0, "step": step + 1, "phase": "metrics",
                                                       "pid": read_host_status(tmp_path / "churn", 0)["pid"]}


def test_a_cancel_stops_after_that_step_with_a_checkpoint(tmp_path):
    result, session, out = _run(tmp_path, 5, cancel_at=1)
    assert (result.status, result.steps_done) == ("cancelled", 2)
    # Step 0's state is saved when step 1 starts; the cancelled step's own save is the forced one.
    assert session.saves == [False, True]
    assert [r["step"] for r in m.read_jsonl(out / METRICS_FILE) if r["host"] == m.ALL_HOSTS] == [0, 1]


def test_a_steps_state_is_saved_only_once_its_metrics_are_on_disk(tmp_path):
    """Otherwise a host lost between the save and the metrics gather leaves a checkpointed step whose
    metrics no one wrote, and the resumed run starts after it (a lost step)."""
    _, session, _ = _run(tmp_path, 3)
    assert session.steps_logged_at_save == [[0], [0, 1], [0, 1, 2]]


def test_a_cancel_in_the_last_step_counts_unless_the_mode_finishes_anyway(tmp_path):
    cancelled, _, _ = _run(tmp_path / "a", 2, cancel_at=1)
    finished, _, _ = _run(tmp_path / "b", 2, cancel_at=1, last_step_ignores_cancel=True)  # SFT's rule
    assert (cancelled.status, finished.status) == ("cancelled", "succeeded")


def test_the_checksum_is_one_device_scalar_that_tells_params_apart():
    params = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones((4,), jnp.bfloat16)}
    first = params_checksum(params)
    assert isinstance(first, jax.Array) and first.shape == () and first.dtype == jnp.uint32
    elsewhere = params_checksum(jax.device_put(params, jax.devices()[-1]))
    assert float(first) == float(elsewhere)
    swapped = {"w": params["w"][::-1], "b": params["b"]}  # the same values in another order
    nudged = {"w": params["w"].at[0, 0].add(1e-6), "b": params["b"]}
    assert len({float(first), float(params_checksum(swapped)), float(params_checksum(nudged))}) == 3
    assert np.asarray(first).item() == float(first)  # a uint32 is exact as a float


def test_the_checksum_covers_every_shard_of_a_leaf_sharded_over_the_hosts_devices():
    # The 4 CPU devices tests/locojax/conftest.py gives this process, as FSDP 2 x tensor 2.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    sharded = NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    values = {"w": jnp.arange(32, dtype=jnp.float32).reshape(4, 8), "b": jnp.ones((8,), jnp.bfloat16)}
    params = {"w": jax.device_put(values["w"], sharded),
              "b": jax.device_put(values["b"], NamedSharding(mesh, PartitionSpec("tensor")))}
    assert len({shard.device for shard in params["w"].addressable_shards}) == 4
    checksum = params_checksum(params)
    assert isinstance(checksum, jax.Array) and checksum.shape == () and checksum.dtype == jnp.uint32
    # A change in the second shard only (row 0, columns 4..7 live on the (fsdp 0, tensor 1) device).
    second = next(shard for shard in params["w"].addressable_shards if shard.index[1].start == 4
                  and not shard.index[0].start)
    assert second.device != params["w"].addressable_shards[0].device
    nudged = {**params, "w": jax.device_put(values["w"].at[0, 5].add(1.0), sharded)}
    assert float(params_checksum(nudged)) != float(checksum)
    # The same values replicated, or on one device, give the same checksum: it depends on values only.
    replicated = jax.device_put(values, NamedSharding(mesh, PartitionSpec()))
    assert float(params_checksum(replicated)) == float(checksum) == float(params_checksum(values))


def test_the_checksum_is_due_only_when_the_spec_asks():
    default = parse_spec({})
    every_two = parse_spec({"debug": {"checksum_every": 2}})
    assert not any(checksum_due(default, step) for step in range(5))
    assert [checksum_due(every_two, step) for step in range(5)] == [True, False, True, False, True]
    assert CHECKSUM_KEY == "params/checksum"
