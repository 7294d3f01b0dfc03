"""What the dashboard shows of the placement model's learning, read through `services.calibration`:
on a run page, what the model predicted for the run on its hosts' hardware beside what it measured
(step and phases) and where its TensorBoard event files are; on the placement page, each hardware's
prediction error per run over time (a uPlot chart), its observations and its calibration versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from locojax import contract as c
from server.models import Calibration, CalibrationObservation, Run
from server.services import calibration as calibration_service
from server.settings import Settings

# (measured field, the metric it is the median of, label) of what the run page compares.
COMPARED = (("step_s", c.TIME_STEP, "Step"), ("rollout_s", c.TIME_ROLLOUT, "Rollout"),
            ("reward_s", c.TIME_REWARD, "Reward"), ("train_s", c.TIME_TRAIN, "Train"))
OBSERVATIONS_SHOWN = 50


@dataclass(frozen=True)
class ComparedTime:
    label: str
    predicted: float | None
    measured: float | None

    @property
    def rel_error(self) -> float | None:
        if not self.predicted or not self.measured:
            return None
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class RunPrediction:
    hardware: str | None
    calibration: Calibration | None
    error: str | None  # why the model could not price it
    rows: list[ComparedTime]
    measured_label: str  # "median after warm-up" (its observation) or "latest step"
    observation: CalibrationObservation | None
    tensorboard: str  # where the run's event files are, on the hosts' file system

    @property
    def priced(self) -> bool:
        return any(row.predicted is not None for row in self.rows)


def run_prediction(session: Session, run: Run, latest: dict[str, tuple[int, float]], settings: Settings
                   ) -> RunPrediction:
    predicted = run.predicted or {}
    observation = calibration_service.observation_for_run(session, run.id)
    if observation is not None:
        measured = {name: observation.measured.get(name) for name, _, _ in COMPARED}
        label = f"median of {observation.measured.get('steps')} steady step(s)"
    else:
        measured = {name: latest[key][1] if key in latest else None for name, key, _ in COMPARED}
        label = f"latest step ({latest[c.TIME_STEP][0]})" if c.TIME_STEP in latest else ""
    calibration = calibration_service.get_version(session, run.calibration_id) if run.calibration_id else None
    rows = [ComparedTime(text, predicted.get(name), measured.get(name)) for name, _, text in COMPARED]
    directory = Path(settings.runs_root) / c.run_dir_name(run.id, run.name) / c.TENSORBOARD_DIR
    return RunPrediction(hardware=run.hardware, calibration=calibration, error=predicted.get("error"), rows=rows,
                         measured_label=label, observation=observation, tensorboard=str(directory))


@dataclass(frozen=True)
class HardwareLearning:
    hardware: str
    versions: list[Calibration]
    stale: bool  # observations changed since the active version was fitted

    @property
    def active(self) -> Calibration | None:
        return next((version for version in self.versions if version.active), None)


@dataclass(frozen=True)
class Learning:
    chart: dict[str, Any]
    observations: list[CalibrationObservation]
    hardware: list[HardwareLearning] = field(default_factory=list)

    @staticmethod
    def rel_error(observation: CalibrationObservation) -> float | None:
        return calibration_service.relative_error(observation)


def error_chart(series: dict[str, list[tuple[Any, float, int]]]) -> dict[str, Any]:
    """The placement page's chart, shaped like the run charts (`web.charts.chart_data`) but over time:
    x is each observation's time (Unix seconds), one series per hardware of its step error in %."""
    times = sorted({point[0].timestamp() for points in series.values() for point in points})
    position = {moment: index for index, moment in enumerate(times)}
    columns = []
    for hardware, points in series.items():
        column: list[float | None] = [None] * len(times)
        for moment, error, _ in points:
            column[position[moment.timestamp()]] = round(100 * error, 3)
        columns.append({"label": hardware, "last": column})
    return {"id": "prediction-error", "title": "Prediction error per run (predicted / measured step - 1)",
            "unit": "%", "stacked": False, "time": True, "x": times, "series": columns,
            "points": len(times), "bucket_steps": 1}


def learning(session: Session) -> Learning:
    series = calibration_service.prediction_errors(session)
    observations, _ = calibration_service.list_observations(session, hardware=None, limit=OBSERVATIONS_SHOWN,
                                                            cursor=None)
    versions = calibration_service.list_versions(session, None)
    names = sorted({v.hardware for v in versions} | {o.hardware for o in observations})
    hardware = [HardwareLearning(name, [v for v in versions if v.hardware == name],
                                 calibration_service.stale(session, name)) for name in names]
    return Learning(chart=error_chart(series), observations=observations, hardware=hardware)
