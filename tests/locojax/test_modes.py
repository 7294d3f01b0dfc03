"""SC and DA next to CO: same kernels, DA staleness, failures that end runs quickly, clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locojax import metrics as m
from tests.conftest import session_processes
from tests.locojax.test_co import (ROOT, TEST_REWARD_MODULES, assert_trees_close, checkpoint_params, engine_command,
                                   locojax, tiny_spec, write_spec)

# The in-process runs score the test rewards too.
pytestmark = pytest.mark.usefixtures("test_rewards_allowed")


def _processes(pattern: str) -> list[int]:
    return session_processes(pattern)


@pytest.mark.multiprocess
def test_da_samples_batch_t_plus_1_with_exactly_theta_t(tmp_path):
    spec = write_spec(tmp_path, {**tiny_spec(tmp_path, "da", steps=5,
                                             placement={"mode": "da", "hosts": 2, "rollout_fraction": 0.5}),
                                 "debug": {"checksum_every": 1}})  # checksums are reported only when asked
    done = locojax("train", str(spec), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["step"]: r for r in m.read_jsonl(tmp_path / "da" / "metrics.jsonl") if r["host"] == "all"}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    # Batch 0 and 1 are sampled with θ0; batch s (s >= 2) with θ_{s-1}, the params after train step s-2.
    assert rows[0]["da/rollout_checksum"] == rows[1]["da/rollout_checksum"]
    assert rows[0]["da/staleness"] == 0 and all(rows[s]["da/staleness"] == 1 for s in range(1, 5))
    for s in range(2, 5):
        assert rows[s]["da/rollout_checksum"] == rows[s - 2]["params/checksum"]
        assert rows[s]["da/rollout_version"] == s - 1
    assert len({rows[s]["params/checksum"] for s in range(5)}) == 5, "every step should move the params"
    for key in (m.TIME_WEIGHT_SYNC, m.DA_ROLLOUT_IDLE, m.DA_TRAIN_IDLE):
        assert key in rows[3]
    # Ray is gone: no raylet, GCS or worker left, and nothing written to the home directory.
    assert not _processes("raylet") and not _processes("gcs_server") and not _processes("ray::")
    assert not (Path.home() / ".ray").exists() or not any((Path.home() / ".ray").glob("*token*"))


# How long a failed DA driver's Ray processes (raylet, GCS) may outlive it.
RAY_GONE_WITHIN_S = 10.0


def _wait_until_gone(patterns: tuple[str, ...], timeout_s: float) -> list[int]:
    """Poll until no process of this session matches any of `patterns`; the pids still there at the
    deadline (empty once they are all gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pattern in patterns for pid in _processes(pattern)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _start(args, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(engine_command(*args), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_step(metrics: Path, step: int, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and any(r["step"] >= step for r in m.read_jsonl(metrics)):
            return
        time.sleep(0.1)
    raise AssertionError(f"run did not reach step {step}")


@pytest.mark.multiprocess
def test_co_host_failure_ends_the_run_naming_host_and_phase(tmp_path):
    spec = write_spec(tmp_path, tiny_spec(tmp_path, "co-fail", steps=200, placement={"hosts": 2}))
    process = _start(["train", str(spec), "--quiet"], tmp_path)
    _wait_for_step(tmp_path / "co-fail" / "metrics.jsonl", 1, process)
    victim = [pid for pid in _processes("locojax.cli host") if "--process-id 1" in
              Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()][0]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert process.returncode != 0
    assert "host 1" in stderr and "signal 9" in stderr and " during " in stderr
    assert not _processes("locojax.cli host")


@pytest.mark.multiprocess
def test_sc_worker_failure_ends_the_run_naming_the_worker_and_phase(tmp_path):
    spec = write_spec(tmp_path, tiny_spec(tmp_path, "sc-fail", steps=200, placement={"mode": "sc", "hosts": 2}))
    process = _start(["train", str(spec), "--quiet"], tmp_path)
    _wait_for_step(tmp_path / "sc-fail" / "metrics.jsonl", 1, process)
    from locojax.launch import cores_for_host

    def rank_of(pid: int) -> int:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return int(words[words.index("--process-id") + 1])

    workers = {rank_of(pid): pid for pid in _processes("locojax.cli sc-worker")}
    # Each worker on its own host's cores, as CO's hosts are (they all sat on the controller's once).
    assert {rank: sorted(os.sched_getaffinity(pid)) for rank, pid in workers.items()} == {
        rank: cores_for_host(rank, 2) for rank in (0, 1)}
    victim = workers[1]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=120)
    # The surviving worker cannot finish anything with its job (a checkpoint's commit, JAX's shutdown
    # barrier) once its peer is dead, so the controller kills it at once: it used to wait for it to exit
    # until the 30 s stop deadline (SC's STOP_TIMEOUT_S), which a merely hung worker still gets.
    assert time.monotonic() - killed_at < 20, stderr[-2000:]
    assert process.returncode != 0
    assert "SC worker 1" in stderr and " during " in stderr and "of step" in stderr, stderr[-2000:]
    assert not _processes("locojax.cli sc-worker")  # the other worker went with its controller


@pytest.mark.multiprocess
def test_da_rollout_host_failure_ends_the_run_naming_host_and_phase(tmp_path):
    spec = write_spec(tmp_path, tiny_spec(tmp_path, "da-fail", steps=200, checkpoint={"every": 1, "keep": 2},
                                          placement={"mode": "da", "hosts": 2, "rollout_fraction": 0.5}))
    process = _start(["train", str(spec), "--quiet"], tmp_path)
    _wait_for_step(tmp_path / "da-fail" / "metrics.jsonl", 2, process)
    victim = _processes("ray::RolloutHost")[0]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert process.returncode != 0
    assert "rollout host 0" in stderr and ("rollout of step" in stderr or "weight load" in stderr)
    # A step's state is saved only once its metrics are written: a resume from the latest checkpoint
    # starts right after the last step in metrics.jsonl, so none is lost (a save inside the train step,
    # before a failed weight push, left a checkpoint ahead of the log).
    logged = {r["step"] for r in m.read_jsonl(tmp_path / "da-fail" / "metrics.jsonl") if r["host"] == m.ALL_HOSTS}
    saved = [int(p.name) for p in (tmp_path / "da-fail" / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved and max(saved) <= len(logged) == max(logged) + 1, (sorted(saved), sorted(logged))
    # The driver's ray.shutdown() stops its raylet and GCS, which may outlive the driver by a moment.
    leftovers = _wait_until_gone(("raylet", "gcs_server"), RAY_GONE_WITHIN_S)
    assert not leftovers, f"Ray processes {leftovers} still there {RAY_GONE_WITHIN_S} s after the driver exited"


SAVES_AT_EACH_LOG = """
import json, sys
from pathlib import Path

from locojax.commands import _allow_rewards, configure_jax
from locojax.modes import isolate_network, spec_mode
from locojax.spec import load_spec

spec = load_spec(sys.argv[1])
_allow_rewards(spec, sys.argv[2], sys.argv[1])
isolate_network(spec, None)
configure_jax(spec_mode(spec).local_devices(spec.placement))
from locojax.runner import run_mode  # JAX starts here, after the re-execution into the private network
checkpoints, seen = Path(spec.output_dir) / "checkpoints", []


class SavesAtEachLog:  # the checkpoints on disk when the loop logs a step's aggregate row
    def write(self, step, host, metrics):
        if host == "all":
            # A save under way counts as begun: Orbax writes it to `<step>.orbax-checkpoint-tmp-*` first.
            seen.append([step, sorted(int(p.name.split(".")[0]) for p in checkpoints.glob("[0-9]*"))])

    def close(self):
        pass


run_mode(spec, console=False, extra_sinks=[SavesAtEachLog()])
print("SAVES_AT_EACH_LOG", json.dumps(seen))
"""


@pytest.mark.multiprocess
def test_da_saves_a_steps_state_only_once_its_metrics_are_logged(tmp_path):
    """As the loop does for every mode: a DA train host that saved inside its train step let a node
    lost at the weight push that follows leave a checkpoint ahead of metrics.jsonl, and the resumed
    run skipped that step's metrics."""
    spec = write_spec(tmp_path, tiny_spec(tmp_path, "da-order", steps=5, checkpoint={"every": 1, "keep": 10},
                                          placement={"mode": "da", "hosts": 2, "rollout_fraction": 0.5}))
    program = tmp_path / "saves_at_each_log.py"
    program.write_text(SAVES_AT_EACH_LOG)
    done = subprocess.run([sys.executable, str(program), str(spec), TEST_REWARD_MODULES], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("SAVES_AT_EACH_LOG")]
    seen = json.loads(line.split(" ", 1)[1])
    assert [step for step, _ in seen] == [0, 1, 2, 3, 4]
    for step, saved in seen:
        # The state after `step` steps is checkpoint `step`: logging step s, the latest save is s.
        assert max(saved, default=0) <= step, (step, saved)
    assert sorted(int(p.name) for p in (tmp_path / "da-order" / "checkpoints").iterdir() if p.name.isdigit()) \
        == [1, 2, 3, 4, 5]


def _params_after(run_dir: Path, step: int):
    return checkpoint_params(run_dir, step)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sc_trains_like_co_without_and_with_the_kl_penalty(tmp_path):
    """Same kernels: a single controller over 2 devices and 2 CO host processes reach the same params,
    without a KL term and with one. SC's KL path is CO's: the same frozen reference (the starting
    policy) and the same jitted log-prob kernel.

    Both reduce the gradient over 2 devices in the same order, so they agree to 1e-5; a large
    coefficient makes the penalty move the params by more than 5e-3 (against the kl_coef 0 CO run),
    500 times the tolerance, so an SC that skipped or mis-aligned the reference could not pass.
    (One test since issue 38: the KL's effect is measured against the kl_coef 0 run the comparison
    without KL makes anyway, instead of a fifth run.)"""
    def spec(name, kl, mode):
        return {**tiny_spec(tmp_path, name, placement={"mode": mode, "hosts": 2}), "algo": {"kl_coef": kl}}

    for name, kl, mode in (("sc", 0.0, "sc"), ("co", 0.0, "co"), ("sc-kl", 1.0, "sc"), ("co-kl", 1.0, "co")):
        done = locojax("train", str(write_spec(tmp_path, spec(name, kl, mode))), "--quiet")
        assert done.returncode == 0, done.stderr[-3000:]
    sc, co = (checkpoint_params(tmp_path / name, 3) for name in ("sc", "co"))
    assert_trees_close(sc, co, atol=1e-5)

    sc_rows = [r for r in m.read_jsonl(tmp_path / "sc-kl" / "metrics.jsonl") if r["host"] == "all"]
    co_rows = [r for r in m.read_jsonl(tmp_path / "co-kl" / "metrics.jsonl") if r["host"] == "all"]
    # Step 0 trains the reference itself (KL 0); later steps have moved away from it.
    assert sc_rows[0][m.LOSS_KL] == pytest.approx(0.0, abs=1e-6) and sc_rows[2][m.LOSS_KL] > 1e-5
    for sc_row, co_row in zip(sc_rows, co_rows, strict=True):
        assert sc_row[m.LOSS_KL] == pytest.approx(co_row[m.LOSS_KL], rel=1e-4, abs=1e-7)
    sc_kl, co_kl = (_params_after(tmp_path / name, 3) for name in ("sc-kl", "co-kl"))
    assert_trees_close(sc_kl, co_kl, atol=1e-5)
    import jax
    import numpy as np

    kl_effect = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                    for a, b in zip(jax.tree.leaves(co_kl), jax.tree.leaves(co)))
    assert kl_effect > 5e-3, f"the KL penalty moved the params by only {kl_effect:.2e}, within reach of the tolerance"
    assert not _processes("locojax.cli host")


@pytest.mark.slow
def test_resumed_run_keeps_the_starting_policy_as_kl_reference(tmp_path):
    """The KL reference is the run's starting policy, also after a resume (it used to be the
    restored params, so a resumed run penalised against a different policy than a straight one)."""
    from locojax.modes.co import run_co
    from locojax.spec import parse_spec

    def spec(name, steps):
        return parse_spec({**tiny_spec(tmp_path, name, steps=steps, checkpoint={"every": 2, "keep": 3}),
                           "algo": {"kl_coef": 1.0}})

    run_co(spec("straight", 4), console=False)
    run_co(spec("resumed", 2), console=False)
    result = run_co(spec("resumed", 4), resume=True, console=False)
    assert result.steps_done == 4
    assert_trees_close(_params_after(tmp_path / "straight", 4), _params_after(tmp_path / "resumed", 4), atol=1e-6)
