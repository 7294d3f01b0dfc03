"""What every run writes and reads in its output directory, whatever its mode (CO, SC, DA, SFT):
`spec.yaml`, `metrics.jsonl` (host 0), `hosts/host<i>.json` (where each host is), `result.json`,
and the cooperative cancel flag. The launcher and the worker read the same files."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

from locojax import metrics as m
from locojax.spec import RunSpec, dump_spec


@dataclasses.dataclass
class RunResult:
    status: str  # "succeeded" | "cancelled"
    steps_done: int
    last_checkpoint_step: int | None
    final_metrics: dict[str, float]


def output_dir(spec: RunSpec) -> Path:
    return Path(spec.output_dir or Path("runs") / spec.name)


def start_output(spec: RunSpec, host: int) -> Path:
    out = output_dir(spec)
    if host == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.yaml").write_text(dump_spec(spec), encoding="utf-8")
    return out


def make_logger(spec: RunSpec, out: Path, host: int, start_step: int, console: bool,
                extra_sinks: Sequence[m.MetricSink]) -> m.MetricsLogger:
    """Host 0 writes the run's records (per host and aggregate) to metrics.jsonl and the console."""
    sinks = list(extra_sinks)
    if host == 0:
        sinks = [m.JsonlSink(out / "metrics.jsonl")] + sinks
        if console:
            sinks.append(m.ConsoleSink(spec.steps, description=spec.name, start_step=start_step))
    return m.MetricsLogger(sinks)


class HostStatus:
    """Where this host is (step, phase), in `<output_dir>/hosts/host<i>.json`, so that when a host
    dies the launcher or worker can say in which phase it was lost."""

    def __init__(self, out: Path, host: int):
        self.host = host
        self.path = out / "hosts" / f"host{host}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, step: int, phase: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": self.host, "step": step, "phase": phase, "pid": os.getpid()}))
        tmp.replace(self.path)  # atomic: a reader never sees half a file


def read_host_status(out: Path, host: int) -> dict | None:
    try:
        return json.loads((out / "hosts" / f"host{host}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def cancel_requested(cancel_file: str | Path | None) -> bool:
    return cancel_file is not None and Path(cancel_file).exists()


def finish(out: Path, host: int, result: RunResult) -> RunResult:
    if host == 0:
        (out / "result.json").write_text(json.dumps(dataclasses.asdict(result), indent=2), encoding="utf-8")
    return result
