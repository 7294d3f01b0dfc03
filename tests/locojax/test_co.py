"""CO mode (DESIGN §5): synchronous and exact across host layouts, exact resume, an honest split."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from locojax import metrics as m
from locojax.checkpoint import load_params
from locojax.model import create_model, get_preset
from tests.locojax.rewards_for_tests import SLEEP_PER_BATCH_S
from locojax.spec import RunSpec

ROOT = Path(__file__).resolve().parents[2]
# The operator's allowlist these tests run under: the test rewards' module, nothing else.
TEST_REWARD_MODULES = "tests.locojax.rewards_for_tests"
DENSE_REWARD = "tests.locojax.rewards_for_tests:digit_fraction"
SLEEPY_REWARD = "tests.locojax.rewards_for_tests:sleep_50ms_per_batch"


def tiny_spec(tmp_path: Path, name: str, **overrides) -> dict:
    spec = {
        "name": name, "seed": 3,
        "model": {"preset": "tiny"},
        "task": {"name": "arith", "difficulty": 1, "reward": ["gsm8k", DENSE_REWARD]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_prompt_tokens": 48, "max_new_tokens": 8},
        # A large rate so three steps move the params visibly: equality must not hold by inertia.
        "optim": {"lr": 3e-3, "warmup_steps": 0},
        "steps": 3,
        "placement": {"mode": "co", "hosts": 1, "devices_per_host": 1},
        "checkpoint": {"every": 3, "keep": 2},
        "output_dir": str(tmp_path / name),
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def write_spec(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def engine_command(*args: str) -> list[str]:
    """`locojax ARGS`, allowed the test rewards when it runs a spec."""
    allow = ["--reward-modules", TEST_REWARD_MODULES] if args and args[0] in ("train", "host", "launch", "eval") else []
    return [sys.executable, "-m", "locojax.cli", *args, *allow]


def locojax(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(engine_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=300, **kwargs)


def checkpoint_params(run_dir: Path, step: int):
    template = nnx.split(create_model(get_preset("tiny")))[1]
    return load_params(run_dir / "checkpoints", template, step)


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


@pytest.mark.multiprocess
def test_two_hosts_equal_one_host_with_two_devices(tmp_path):
    # The checksum the hosts compare below is reported only when the spec asks for it.
    two_hosts = write_spec(tmp_path, {**tiny_spec(tmp_path, "two-hosts"), "debug": {"checksum_every": 1}})
    one_host = write_spec(tmp_path, tiny_spec(tmp_path, "one-host"))
    done = locojax("launch", str(two_hosts), "--hosts", "2", "--devices-per-host", "1", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    done = locojax("launch", str(one_host), "--hosts", "1", "--devices-per-host", "2", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]

    a, b = checkpoint_params(tmp_path / "two-hosts", 3), checkpoint_params(tmp_path / "one-host", 3)
    assert_trees_close(a, b, atol=1e-5)
    start = nnx.split(create_model(get_preset("tiny"), seed=3))[1]
    moved = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(start)))
    assert moved > 1e-3, "three steps should have changed the params"

    # Every step, both hosts report the same params checksum.
    rows = m.read_jsonl(tmp_path / "two-hosts" / "metrics.jsonl")
    for step in range(3):
        sums = {r["host"]: r["params/checksum"] for r in rows if r["step"] == step and r["host"] != "all"}
        assert set(sums) == {0, 1} and sums[0] == sums[1]


def test_params_already_on_the_rollout_devices_are_handed_over_not_copied(four_cpu_devices):
    """One device (or the same devices, replicated): to_local hands the train state's own arrays to the
    rollout, and the compiled plan's abstract params agree (`already_local`), so it lowers the programs
    for what the run passes. Sharded over the train mesh's devices, they are copied, replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from locojax.model.sharding import make_mesh
    from locojax.policy import already_local, to_local
    from locojax.rollout import rollout_mesh

    values = np.arange(32, dtype=np.float32).reshape(4, 8)
    one = make_mesh(jax.devices()[:1])
    on_one = {"w": jax.device_put(values, NamedSharding(one, P(None, "fsdp")))}  # replicated on one device
    rollout_one = NamedSharding(rollout_mesh(1, jax.devices()[:1]), P())
    assert to_local(on_one, rollout_one)["w"] is on_one["w"]
    abstract = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=on_one["w"].sharding)}
    assert already_local(abstract, rollout_one)

    two = make_mesh(jax.devices()[:2], fsdp=2)
    sharded = {"w": jax.device_put(values, NamedSharding(two, P("fsdp", None)))}
    rollout_two = NamedSharding(rollout_mesh(2, jax.devices()[:2]), P())
    assert not already_local(sharded, rollout_two)
    local = to_local(sharded, rollout_two)
    assert local["w"] is not sharded["w"] and local["w"].is_fully_replicated
    assert local["w"].sharding.is_equivalent_to(rollout_two, 2)
    np.testing.assert_array_equal(np.asarray(local["w"]), values)


@pytest.mark.usefixtures("test_rewards_allowed")
def test_a_run_with_the_early_forward_equals_one_with_the_one_program_step(tmp_path, monkeypatch):
    """placement.early_forward moves the update's forward pass ahead of the rewards, nothing else: the
    same losses, rewards and params after three steps (float32 rounding of two programs against one),
    and the spec refuses it where it cannot apply, saying why."""
    from locojax.modes.co import run_co
    from locojax.train import EarlyForwardStep

    forwards = []
    real_forward = EarlyForwardStep.forward
    monkeypatch.setattr(EarlyForwardStep, "forward",
                        lambda self, *args: forwards.append(1) or real_forward(self, *args))
    results = {}
    for early in (True, False):
        name = f"early-{early}".lower()
        spec = RunSpec.model_validate(tiny_spec(tmp_path, name, algo={"kl_coef": 0.05},
                                                placement={"early_forward": early}))
        assert run_co(spec, console=False).status == "succeeded"
        records = [r for r in m.read_jsonl(tmp_path / name / "metrics.jsonl") if r["host"] == m.ALL_HOSTS]
        results[early] = records, checkpoint_params(tmp_path / name, 3)
    assert len(forwards) == 3  # the early run's three steps; the other run's none
    (early_records, early_params), (fused_records, fused_params) = results[True], results[False]
    assert [r["step"] for r in early_records] == [r["step"] for r in fused_records] == [0, 1, 2]
    for early_record, fused_record in zip(early_records, fused_records):
        for key in (m.LOSS_POLICY, m.LOSS_KL, m.POLICY_GRAD_NORM, m.REWARD_MEAN):
            assert early_record[key] == pytest.approx(fused_record[key], rel=1e-4, abs=1e-6), key
    # Within 1% of one AdamW step (lr 3e-3): Adam divides each element's gradient by its own scale, so an
    # element whose gradient is ~0 moves by a rounding-dependent part of lr (1.6e-5 seen, run alone).
    assert_trees_close(early_params, fused_params, atol=0.01 * spec.optim.lr)
    moved = checkpoint_params(tmp_path / "early-true", 3)
    initial = nnx.split(create_model(get_preset("tiny")))[1]
    assert not all(np.allclose(np.asarray(a), np.asarray(b)) for a, b in
                   zip(jax.tree.leaves(moved), jax.tree.leaves(initial)))
    with pytest.raises(ValueError, match=r"placement.early_forward: true, but it needs algo.num_iterations 1"):
        run_co(RunSpec.model_validate(tiny_spec(tmp_path, "two-iterations", algo={"num_iterations": 2},
                                                placement={"early_forward": True})), console=False)
    from locojax.spec import SpecError, parse_spec

    with pytest.raises(SpecError, match="placement.early_forward does not apply to mode 'sc'"):
        parse_spec({"placement": {"mode": "sc", "hosts": 2, "early_forward": True}})


# Run as process 0 and 1 of a 2-process job with 2 CPU devices each: the mesh is data 2 (one row per
# process) x fsdp 2 (within each process), the params' layout under placement.fsdp 2 on two hosts.
HOST_LOCAL_PROBE = """
import sys
import jax, jax.numpy as jnp, numpy as np
process, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
from jax.sharding import NamedSharding, PartitionSpec as P
from locojax.model.sharding import make_mesh
from locojax.modes.common import params_checksum
from locojax.policy import host_copy, to_local
from locojax.rollout import rollout_mesh

mesh = make_mesh(jax.devices(), fsdp=2)
values = np.arange(32, dtype=np.float32).reshape(4, 8)
x = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("fsdp", None)), lambda i: values[i])
assert not x.is_fully_addressable and not x.is_fully_replicated
local = host_copy(x)  # on this process's devices, not a numpy copy
assert isinstance(local, jax.Array) and local.is_fully_addressable, type(local)
assert {d.process_index for d in local.devices()} == {process} and len(local.devices()) == 2
np.testing.assert_array_equal(np.asarray(local), values)
params = to_local({"w": x}, NamedSharding(rollout_mesh(2), P()))
assert params["w"].is_fully_replicated and len(params["w"].devices()) == 2
np.testing.assert_array_equal(np.asarray(params["w"]), values)
# The checksum covers both of this host's shards: it equals the whole array's.
assert float(params_checksum({"w": x})) == float(params_checksum({"w": jnp.asarray(values)}))
# Split across the processes, a host-local copy would need a gather: refused, not half filled.
y = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("data", None)), lambda i: values[i])
try:
    host_copy(y)
except ValueError:
    pass
else:
    raise AssertionError("a leaf split across processes was copied")
jax.distributed.shutdown()
"""


@pytest.mark.multiprocess
def test_the_host_local_params_of_an_fsdp_run_stay_on_its_devices():
    from locojax.launch import free_port

    port = str(free_port())
    processes = [subprocess.Popen([sys.executable, "-c", HOST_LOCAL_PROBE, str(index), port], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for index in (0, 1)]
    outputs = [process.communicate(timeout=240)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], "\n".join(outputs)[-4000:]


@pytest.mark.multiprocess
def test_two_hosts_with_fsdp_equal_one_host_with_the_same_mesh(tmp_path):
    # Placement fsdp 2 on two hosts: each host's rollout reads its params, sharded over its own devices.
    two_hosts = write_spec(tmp_path, {**tiny_spec(tmp_path, "two-hosts", placement={"fsdp": 2, "devices_per_host": 2}),
                                      "debug": {"checksum_every": 1}})
    one_host = write_spec(tmp_path, tiny_spec(tmp_path, "one-host", placement={"fsdp": 2, "devices_per_host": 4}))
    done = locojax("launch", str(two_hosts), "--hosts", "2", "--devices-per-host", "2", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    done = locojax("launch", str(one_host), "--hosts", "1", "--devices-per-host", "4", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trees_close(checkpoint_params(tmp_path / "two-hosts", 3), checkpoint_params(tmp_path / "one-host", 3),
                       atol=1e-5)
    rows = m.read_jsonl(tmp_path / "two-hosts" / "metrics.jsonl")
    for step in range(3):
        sums = {r["host"]: r["params/checksum"] for r in rows if r["step"] == step and r["host"] != "all"}
        assert set(sums) == {0, 1} and sums[0] == sums[1]


@pytest.mark.multiprocess
def test_a_cancelled_local_multi_host_run_exits_with_the_cancelled_code(tmp_path):
    from locojax.contract import EXIT_CANCELLED, read_result

    cancel = tmp_path / "cancel"
    cancel.touch()  # already there: the hosts agree to stop after step 0
    path = write_spec(tmp_path, tiny_spec(tmp_path, "cancelled", placement={"hosts": 2}))
    done = locojax("train", str(path), "--quiet", "--cancel-file", str(cancel))
    assert done.returncode == EXIT_CANCELLED, done.stderr[-3000:]  # not a "host failed" launch error
    result = read_result(tmp_path / "cancelled")
    assert (result.status, result.steps_done) == ("cancelled", 1)


@pytest.mark.multiprocess
def test_resume_after_kill_equals_straight_run(tmp_path):
    straight = write_spec(tmp_path, tiny_spec(tmp_path, "straight", steps=6))
    killed = write_spec(tmp_path, tiny_spec(tmp_path, "killed", steps=6))
    done = locojax("train", str(straight), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]

    process = subprocess.Popen(engine_command("train", str(killed), "--quiet"), cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = tmp_path / "killed" / "checkpoints" / "3" / "commit_success.txt"
    deadline = time.monotonic() + 240
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert marker.exists(), "the run never wrote its step-3 checkpoint"
    assert not (tmp_path / "killed" / "checkpoints" / "6").exists(), "killed too late to test resume"

    done = locojax("train", str(killed), "--resume", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trees_close(checkpoint_params(tmp_path / "straight", 6), checkpoint_params(tmp_path / "killed", 6),
                       atol=0)
    rows = {(r["step"]): r for r in m.read_jsonl(tmp_path / "straight" / "metrics.jsonl") if r["host"] == "all"}
    resumed = [r for r in m.read_jsonl(tmp_path / "killed" / "metrics.jsonl") if r["host"] == "all"]
    for row in resumed:
        if row["step"] >= 3:
            assert row["reward/mean"] == rows[row["step"]]["reward/mean"]
            assert row["loss/policy"] == rows[row["step"]]["loss/policy"]


@pytest.mark.slow
@pytest.mark.usefixtures("test_rewards_allowed")
def test_reward_sleep_shows_up_as_host_time(tmp_path):
    """Scoring is host time, never device time: in every step, the reward phase (at least the sleepy
    reward's 50 ms) lies within time/host (= time/step less the device and network spans). One-sided,
    so other work on the machine cannot fail it: comparing a sleepy run's least host time with a plain
    run's (as before) failed in a fresh-clone CI at load 4-5, 37 ms apart where the sleep is 50."""
    from locojax.modes.co import run_co

    spec = RunSpec.model_validate(tiny_spec(tmp_path, "sleepy", steps=6, task={"reward": ["gsm8k", SLEEPY_REWARD]},
                                            checkpoint={"every": 0}))
    run_co(spec, console=False)
    rows = [r for r in m.read_jsonl(tmp_path / "sleepy" / "metrics.jsonl") if r["host"] == "all"]
    assert len(rows) == 6
    for row in rows:
        assert row[m.TIME_REWARD] >= SLEEP_PER_BATCH_S
        assert row[m.TIME_HOST] >= row[m.TIME_REWARD] - 1e-6, row


@pytest.mark.slow
@pytest.mark.usefixtures("test_rewards_allowed")
def test_steady_steps_trace_and_compile_nothing(tmp_path, monkeypatch):
    """After its first steps a CO run reuses every compiled program: a retrace or recompile per step would
    cost a TPU run seconds a step (a shape, a Python scalar or a sharding that changes between steps).
    And the host prepares each next rollout's inputs before it waits on the current one's tokens, not
    after the train step's dispatch, where the device would wait on it."""
    import jax.monitoring

    from locojax.modes import common
    from locojax.modes.co import run_co

    order: list[str] = []
    real_prepare, real_texts = common.RolloutRunner.prepare, common.RolloutRunner.texts
    monkeypatch.setattr(common.RolloutRunner, "prepare",
                        lambda self, *args: order.append("prepare") or real_prepare(self, *args))
    monkeypatch.setattr(common.RolloutRunner, "texts",
                        lambda self, *args: order.append("texts") or real_texts(self, *args))

    events: list[str] = []
    watched = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")

    def count(event: str, duration_s: float, **_) -> None:
        if event in watched:
            events.append(event)

    class StepMarks:
        """The number of trace and compile events seen when each step's record was logged."""

        def __init__(self):
            self.seen: dict[int, int] = {}
            self.setup: dict[int, float] = {}

        def write(self, step, host, metrics):
            if host == m.ALL_HOSTS:
                self.seen[step] = len(events)
                if m.TIME_SETUP in metrics:
                    self.setup[step] = metrics[m.TIME_SETUP]
                    self.setup_parts = {name: metrics.get(name) for name in m.SETUP_PARTS}

        def close(self):
            pass

    marks = StepMarks()
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        spec = RunSpec.model_validate(tiny_spec(tmp_path, "steady", steps=6, checkpoint={"every": 0}))
        run_co(spec, console=False, extra_sinks=[marks])
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    # Step 0's own inputs, then each step's next ones before its tokens are read; none after the last.
    assert order == ["prepare"] + ["prepare", "texts"] * 5 + ["texts"]
    assert marks.seen[0] > 0  # the first step compiled: the listener sees what it should
    # Step 1's rollout was dispatched during step 0; from step 2 on nothing is new.
    assert marks.seen[5] == marks.seen[1], events[marks.seen[1]:]
    # What came before the loop (the model built, programs compiled) is reported once, on step 0: a
    # first step's cost is time/setup + its time/step, whichever of the two the compilation lands in.
    assert list(marks.setup) == [0] and marks.setup[0] > 0
    # Its parts: on the CPU the programs compile in step 0, not in setup; building the model is timed.
    parts = marks.setup_parts
    assert parts[m.TIME_SETUP_COMPILE] == 0.0
    assert 0 < parts[m.TIME_SETUP_MODEL] <= marks.setup[0]
    # The backend was open before this run (the test process started it): nothing left to start.
    assert 0 <= parts[m.TIME_SETUP_BACKEND] < 0.1 * marks.setup[0]
