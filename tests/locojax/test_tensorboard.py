"""TensorBoard event files beside metrics.jsonl, read back with TensorBoard's own reader, and the run's
environment.json (what it ran on and what it trained)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from locojax import metrics as m
from locojax.contract import ENVIRONMENT_FILE, METRICS_FILE, TENSORBOARD_DIR, EngineEnvironment, read_environment
from locojax.runner import run
from locojax.spec import parse_spec
from locojax.tensorboard import TensorBoardSink
from tests.locojax.test_runner import CountingSession

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_scalars(directory) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard finds in `directory`: {tag: {step: value}}."""
    accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def test_every_metric_of_every_host_and_the_aggregate_reads_back(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb", flush_s=60.0)  # only close flushes here
    logger = m.MetricsLogger([sink, m.JsonlSink(tmp_path / METRICS_FILE)])
    for step in range(5):
        logger.log_hosts(step, [{m.TIME_STEP: 0.5 + step, m.REWARD_MEAN: 0.25 * host + step / 10,
                                 m.TIME_ROLLOUT: float("nan") if step == 2 else 0.125}
                                for host in range(2)])
    logger.close()
    records = m.read_jsonl(tmp_path / METRICS_FILE)
    assert sorted(path.name for path in (tmp_path / "tb").iterdir()) == ["all", "host0", "host1"]
    for directory in ("host0", "host1", "all"):
        scalars = read_scalars(tmp_path / "tb" / directory)
        host = m.ALL_HOSTS if directory == "all" else int(directory[4:])
        mine = [r for r in records if r["host"] == host]
        assert len(mine) == 5
        for record in mine:
            for key, value in record.items():
                if key in ("step", "host"):
                    continue
                read = scalars[key][record["step"]]
                if value is None:  # JSONL writes NaN as null; TensorBoard keeps the NaN
                    assert math.isnan(read)
                else:
                    assert read == pytest.approx(value, rel=1e-6)  # float32 in the event file
        assert set(scalars) == {k for r in mine for k in r if k not in ("step", "host")}


def test_the_run_loop_only_enqueues_and_the_sinks_thread_builds_the_events(tmp_path, monkeypatch):
    """The protocol buffers (~0.1 ms of Python a record) are built on the sink's own thread, never on the
    caller's: every Summary is made there."""
    from locojax import tensorboard

    event, summary, writer = tensorboard._writer_modules()
    built_on: list[str] = []

    def recording_summary(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return summary(*args, **kwargs)

    recording_summary.Value = summary.Value  # the sink builds each value with it
    monkeypatch.setattr(tensorboard, "_writer_modules", lambda: (event, recording_summary, writer))
    sink = TensorBoardSink(tmp_path / "tb")
    record = {f"metric/{index}": index * 0.5 for index in range(60)}
    for step in range(200):
        sink.write(step, 0, record)
    sink.close()
    assert read_scalars(tmp_path / "tb" / "host0")["metric/59"][199] == 29.5
    assert built_on == ["tensorboard-sink"] * 200


SINK_IMPORTS = """
import json, sys, threading
from locojax.tensorboard import TensorBoardSink
imports = []
sys.addaudithook(lambda event, args: imports.append((threading.current_thread().name, args[0]))
                 if event == "import" else None)
sink = TensorBoardSink(sys.argv[1])
made = len(imports)
for step in range(3):
    sink.write(step, 0, {"loss": 1.0 / (step + 1)})
sink.close()
print(json.dumps({"on_other_threads": [name for thread, name in imports if thread != "MainThread"],
                  "when_made": [name for _, name in imports[:made]]}))
"""


def test_the_sinks_thread_imports_nothing_while_steps_run(tmp_path):
    """Everything the sink writes with is imported by the thread that makes it: an import on the sink's
    thread (TensorBoard with boto3, on a TPU VM) ran on into the steady steps and held the
    GIL in bursts the run loop waited behind. A fresh interpreter, so nothing is imported already."""
    done = subprocess.run([sys.executable, "-c", SINK_IMPORTS, str(tmp_path / "tb")], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    imports = json.loads(done.stdout.strip().splitlines()[-1])
    assert imports["on_other_threads"] == []
    assert "tensorboard.summary.writer.event_file_writer" in imports["when_made"]
    assert read_scalars(tmp_path / "tb" / "host0")["loss"][2] == pytest.approx(1 / 3)


def test_a_run_writes_event_files_and_its_environment(tmp_path):
    spec = parse_spec({"name": "counting", "steps": 3, "output_dir": str(tmp_path / "out")})
    run(spec, CountingSession, console=False)
    out = tmp_path / "out"
    scalars = read_scalars(out / TENSORBOARD_DIR / "all")
    assert sorted(scalars[m.LOSS_POLICY]) == [0, 1, 2]
    assert scalars[m.LOSS_POLICY][2] == 2.0
    assert sorted(read_scalars(out / TENSORBOARD_DIR / "host0")[m.TIME_STEP]) == [0, 1, 2]
    environment = read_environment(out)
    assert environment is not None and (out / ENVIRONMENT_FILE).is_file()
    assert (environment.platform, environment.device_kind, environment.hardware) == ("cpu", "cpu", "local-cpu")
    assert environment.processes == 1 and environment.local_devices == environment.devices == 4
    assert environment.model["name"] == "tiny" and environment.model["d_model"] > 0


def test_environment_files_are_checked_field_by_field(tmp_path):
    good = {"platform": "tpu", "device_kind": "TPU v5 lite", "hardware": "tpu-v5e", "devices": 1,
            "local_devices": 1, "processes": 1, "device_memory_bytes": 16 * 2**30, "model": {"d_model": 1024}}
    assert EngineEnvironment.from_json(good).hardware == "tpu-v5e"
    for change, message in (({"devices": 0}, "'devices' must be at least 1"), ({"devices": "1"}, "wrong type"),
                            ({"extra": 1}, "unknown field"), ({"model": None}, "wrong type")):
        with pytest.raises(ValueError, match=message):
            EngineEnvironment.from_json({**good, **change}, "run/environment.json")
    (tmp_path / ENVIRONMENT_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="environment.json: not JSON"):
        read_environment(tmp_path)
