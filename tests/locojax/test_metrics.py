"""Metric names, the phase timer and the device/host/network split, host aggregation, and the sinks."""

import io
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from locojax import metrics as m

DESIGN_NAMES = [  # DESIGN §6, verbatim
    "time/step", "time/rollout", "time/reward", "time/advantage", "time/train", "time/weight_sync",
    "time/checkpoint", "time/device", "time/host", "time/network", "throughput/rollout_tokens_per_s",
    "throughput/train_tokens_per_s", "reward/mean", "reward/std", "reward/frac_zero_std", "loss/policy",
    "loss/kl", "policy/entropy", "policy/clip_frac", "policy/grad_norm", "optim/lr", "completion/len_mean",
    "completion/len_max", "completion/clipped_frac", "da/staleness", "da/rollout_idle", "da/train_idle",
]


def test_every_design_metric_is_defined_once_with_a_description():
    assert set(DESIGN_NAMES) <= set(m.METRICS)
    assert all(info.description and info.name == name for name, info in m.METRICS.items())
    assert m.reward_fn_mean("exact_match") == "reward/exact_match/mean"


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_phase_timer_arithmetic_with_a_fake_clock():
    clock = FakeClock()
    timer = m.PhaseTimer(clock)
    with timer.step():
        with timer.phase(m.TIME_ROLLOUT):
            clock.advance(0.25)  # host: sharding prompts, dispatch
            with timer.device():
                clock.advance(3.0)  # decode
                with timer.device():  # nested split spans count once
                    clock.advance(1.0)
            clock.advance(0.75)  # detokenise
        with timer.phase(m.TIME_REWARD):
            clock.advance(2.0)
        assert timer.last_phase(m.TIME_ROLLOUT) == 5.0 and timer.last_phase(m.TIME_TRAIN) == 0.0
        with timer.phase(m.TIME_TRAIN, split="device"):
            clock.advance(1.5)
        with timer.network():
            clock.advance(0.5)
        with timer.phase(m.TIME_REWARD):  # a phase entered twice adds up
            clock.advance(1.0)
    assert timer.metrics() == {
        m.TIME_ROLLOUT: 5.0, m.TIME_REWARD: 3.0, m.TIME_TRAIN: 1.5,
        m.TIME_STEP: 10.0, m.TIME_DEVICE: 5.5, m.TIME_NETWORK: 0.5, m.TIME_HOST: 4.0,
    }
    with pytest.raises(ValueError, match="split"):
        with timer.phase("x", split="disk"):
            pass


def test_split_step_time_is_the_one_definition():
    assert m.split_step_time(1.0, 0.7, 0.1) == pytest.approx(
        {m.TIME_STEP: 1.0, m.TIME_DEVICE: 0.7, m.TIME_NETWORK: 0.1, m.TIME_HOST: 0.2})
    assert m.split_step_time(1.0, 0.8, 0.3)[m.TIME_HOST] == 0.0  # clamped against timer jitter


def test_split_on_a_workload_whose_split_is_known():
    """A 50 ms sleep is host time; a jitted matmul loop, timed until block_until_ready, is device
    time; a 300 ms simulated transfer is network time.

    No bound depends on how fast this machine is right now: each bucket must hold at least its own
    span, and the host bucket must stay below host sleep + the network span, which it would exceed
    if the network span leaked into it (the slack is 250 ms, far more than load adds to a sleep)."""
    @jax.jit
    def busy(x):
        return jax.lax.fori_loop(0, 60, lambda _, y: jnp.tanh(y @ x), x)

    x = jnp.eye(384, dtype=jnp.float32) * 0.5
    busy(x).block_until_ready()  # compile outside the step
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        busy(x).block_until_ready()
        runs.append(time.perf_counter() - start)
    alone = min(runs)  # best case: the step's run cannot be much faster
    assert alone > 0.01  # enough work to tell apart from dispatch (~0.1 ms)

    timer = m.PhaseTimer()
    with timer.step():
        with timer.phase(m.TIME_ROLLOUT, split="device") as span:
            span.ready(busy(x))
        with timer.phase(m.TIME_REWARD):
            time.sleep(0.05)
        with timer.network():
            time.sleep(0.3)
    t = timer.metrics()
    # Without span.ready the device span would end at dispatch (~0.1 ms) and fail this.
    assert t[m.TIME_DEVICE] >= 0.5 * alone and t[m.TIME_DEVICE] == t[m.TIME_ROLLOUT]
    assert t[m.TIME_NETWORK] >= 0.3
    assert 0.05 <= t[m.TIME_HOST] < 0.05 + 0.25  # the 300 ms network span is not in it
    assert t[m.TIME_STEP] == pytest.approx(t[m.TIME_DEVICE] + t[m.TIME_NETWORK] + t[m.TIME_HOST])


def test_aggregate_hosts_follows_each_metrics_rule():
    hosts = [
        {"step": 3, "time/step": 1.0, "time/rollout": 0.4, "throughput/rollout_tokens_per_s": 100.0,
         "reward/mean": 0.2, "completion/len_max": 7, "reward/exact/mean": 0.0},
        {"step": 3, "time/step": 1.5, "time/rollout": 0.6, "throughput/rollout_tokens_per_s": 50.0,
         "reward/mean": 0.4, "completion/len_max": 9, "reward/exact/mean": 1.0, "da/staleness": 1},
    ]
    assert m.aggregate_hosts(hosts) == pytest.approx({
        "time/step": 1.5, "time/rollout": 0.5, "throughput/rollout_tokens_per_s": 150.0, "reward/mean": 0.3,
        "completion/len_max": 9, "reward/exact/mean": 0.5, "da/staleness": 1,
    })
    assert m.gather_host_metrics({"time/step": 1.0}) == [{"time/step": 1.0}]  # one process


def test_reward_and_completion_summaries():
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])  # groups of 2: [1,0] [1,1] [.5,.5]
    out = m.reward_metrics(rewards, 2, {"exact": np.array([1, 0, 1, 1, 0, 0])})
    assert out[m.REWARD_MEAN] == pytest.approx(4 / 6)
    assert out[m.REWARD_STD] == pytest.approx(np.std(rewards))
    assert out[m.REWARD_FRAC_ZERO_STD] == pytest.approx(2 / 3)
    assert out["reward/exact/mean"] == pytest.approx(0.5)
    mask = np.array([[1, 1, 0], [1, 1, 1]], bool)
    assert m.completion_metrics(mask, finished=np.array([True, False])) == {
        m.COMPLETION_LEN_MEAN: 2.5, m.COMPLETION_LEN_MAX: 3.0, m.COMPLETION_CLIPPED_FRAC: 0.5}


def test_jsonl_sink_writes_flat_records(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = m.JsonlSink(path)
    logger = m.MetricsLogger([sink])
    combined = logger.log_hosts(3, [{"time/step": 1.0, "loss/policy": float("nan")},
                                    {"time/step": 2.0, "loss/policy": float("nan")}])
    logger.log(4, {"reward/mean": jnp.float32(0.5)})
    logger.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == m.read_jsonl(path) == [
        {"step": 3, "host": 0, "time/step": 1.0, "loss/policy": None},
        {"step": 3, "host": 1, "time/step": 2.0, "loss/policy": None},
        {"step": 3, "host": "all", "time/step": 2.0, "loss/policy": None},
        {"step": 4, "host": "all", "reward/mean": 0.5},
    ]
    assert combined["time/step"] == 2.0


class BrokenSink:
    def write(self, step, host, metrics):
        raise ConnectionError("control plane down")

    def close(self):
        pass


class ListSink:
    def __init__(self):
        self.records = []

    def write(self, step, host, metrics):
        self.records.append((step, host, dict(metrics)))

    def close(self):
        pass


def test_a_failing_sink_warns_and_the_others_still_receive():
    good = ListSink()
    assert isinstance(good, m.MetricSink)
    logger = m.MetricsLogger([BrokenSink(), good])
    with pytest.warns(UserWarning, match="BrokenSink failed at step 1"):
        logger.log(1, {"time/step": 0.5}, host=0)
    assert good.records == [(1, 0, {"time/step": 0.5})]


def test_console_sink_shows_step_reward_and_step_time():
    from rich.console import Console

    out = io.StringIO()
    sink = m.ConsoleSink(10, console=Console(file=out, force_terminal=True, width=160))
    sink.write(2, 0, {"reward/mean": 0.9})  # another host's record: ignored
    sink.write(2, "all", {"reward/mean": 0.25, "time/step": 0.5})
    sink.close()
    text = out.getvalue()
    assert "3/10" in text and "0.250" in text and "0.500s" in text and "0.900" not in text


def test_console_sink_draws_on_the_loggers_thread_and_starts_none():
    """rich's refresh thread would draw ten times a second whatever the run loop is doing: the bar is
    drawn when a step is logged instead, at most every `redraw_s`."""
    import threading

    from rich.console import Console

    out = io.StringIO()
    before = set(threading.enumerate())
    sink = m.ConsoleSink(10, console=Console(file=out, force_terminal=True, width=160), redraw_s=3600.0)
    assert set(threading.enumerate()) == before
    drawn = len(out.getvalue())
    sink.write(0, "all", {"reward/mean": 0.125})
    assert len(out.getvalue()) == drawn  # within redraw_s of the last draw: not drawn again
    sink.redraw_s = 0.0
    sink.write(1, "all", {"reward/mean": 0.375})
    assert "2/10" in out.getvalue()[drawn:] and "0.375" in out.getvalue()[drawn:]
    sink.close()


class _ReportingDevice:
    """A device whose runtime reports allocator statistics, as accelerators' do (XLA:CPU's report none)."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_peak_is_the_highest_reported_peak_and_absent_where_nothing_reports():
    gib = 2**30
    devices = [_ReportingDevice({"peak_bytes_in_use": 3 * gib, "bytes_limit": 80 * gib}),
               _ReportingDevice({"peak_bytes_in_use": 5 * gib // 2}), _ReportingDevice(None)]
    assert m.device_memory_metrics(devices) == {"memory/device_peak_gib": 3.0}
    # A TPU runtime reserves programs' temporaries apart from the allocator's buffers: both count.
    tpu = _ReportingDevice({"peak_bytes_in_use": gib, "peak_bytes_reserved": 3 * gib, "bytes_reserved": 3 * gib})
    assert m.device_memory_metrics([*devices, tpu]) == {"memory/device_peak_gib": 4.0}
    assert m.METRICS["memory/device_peak_gib"].across_hosts == "max"
    # XLA:CPU reports no allocator statistics: a CPU run logs no metric rather than a made-up 0.
    if jax.devices()[0].memory_stats() is None:
        assert m.device_memory_metrics(jax.devices()) == {}
