"""The placement model's memory: observations (measured runs) and the calibrations fitted on them.

* **Observations.** A run of this control plane that ends SUCCEEDED (or FAILED or CANCELLED after
  `MIN_STEADY_STEPS_UNFINISHED` steady steps) adds one (`record_run`, called by the lifecycle's
  `transition`): its hardware (the catalog profile of the hosts the scheduler reserved), the model it
  trained, and its median step and phase times after warm-up, from its stored step metrics. Runs
  measured elsewhere join through `import_observation` (`locojax calibration import RUN_DIR`), once per
  run directory (its digest). An admin may exclude an observation from the fits, or include it again.
* **Calibrations.** Per hardware, numbered versions of the refitted profile
  (`locojax.placement.calibration.calibrate` on that hardware's included observations, newest
  `MAX_FIT_OBSERVATIONS`), one of them active. A version goes out of date when an observation of its
  hardware arrives or changes after it became active; `profile_for(..., refit=True)` (a recommendation,
  an import, an exclusion) then fits a new one first. The scheduler prices a run with the active
  version as it stands (`predict_run`: no fit inside its tick). An admin may make an earlier version
  active again (`activate`); it stays active until the next observation changes.
* **Predictions.** When the scheduler reserves a run's hosts it records what the active calibration
  predicts for the run there (`runs.predicted`, `runs.calibration_id`); the run's observation carries
  that prediction, so the placement page can chart each run's prediction error over time.
Profiles without observations keep the catalog's constants: a fit never touches the registry, so the
paper-finding knobs (`cost_model.FITTED_KNOBS`) move only where a profile has observations.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from locojax import contract as c
from server.errors import InvalidInputError, NotFoundError
from server.models import (
    AGGREGATE_HOST,
    Calibration,
    CalibrationObservation,
    Host,
    Run,
    RunStatus,
    StepMetric,
    utcnow,
)
from server.services import events
from server.services import pagination
from server.services.jsonable import jsonable

log = logging.getLogger("locojax.calibration")

# The newest included observations of a hardware that one fit uses (a fit prices each at every step).
MAX_FIT_OBSERVATIONS = 200
# The step metrics an observation's medians are taken from (aggregated rows).
MEASURED_KEYS = (c.TIME_STEP, c.TIME_DEVICE, c.TIME_HOST, c.TIME_NETWORK, c.TIME_ROLLOUT, c.TIME_REWARD,
                 c.TIME_TRAIN, c.TIME_CHECKPOINT, c.COMPLETION_LEN_MEAN)
PHASE_FIELDS = ("rollout_s", "reward_s", "train_s")
SPLIT_FIELDS = ("device_s", "host_s", "network_s")
CONTROL_PLANE = "control plane"


def hardware_of_kind(device_kind: str) -> str | None:
    """The catalog profile a host's `device_kind` names: a catalog name as workers register it now, or
    JAX's own name ("TPU v5 lite", "cpu") from older workers; None when neither."""
    from locojax.placement.hardware import HARDWARE, hardware_for_device

    return device_kind if device_kind in HARDWARE else hardware_for_device(device_kind)


# --- calibrations ----------------------------------------------------------------------------------

def active(session: Session, hardware: str) -> Calibration | None:
    return session.scalar(select(Calibration).where(Calibration.hardware == hardware, Calibration.active))


def stale(session: Session, hardware: str) -> bool:
    """Whether an observation of `hardware` arrived or changed after its active calibration became active."""
    changed = session.scalar(select(func.max(CalibrationObservation.updated_at))
                             .where(CalibrationObservation.hardware == hardware))
    if changed is None:
        return False
    current = active(session, hardware)
    return current is None or current.activated_at is None or changed > current.activated_at


def _observation(row: CalibrationObservation):
    from locojax.placement.calibration import observation_from_payload

    return observation_from_payload({"spec": row.spec, "model": row.model, "measured": row.measured,
                                     "label": row.label}, f"observation {row.id}")


def refit(session: Session, hardware: str, *, by: str | None) -> Calibration:
    """Fit `hardware`'s profile on its included observations and make it the active version. The caller
    commits. With no included observation the new version is the catalog's own profile."""
    from locojax.placement.calibration import calibrate
    from locojax.placement.hardware import HARDWARE

    base = HARDWARE.get(hardware)
    rows = list(session.scalars(select(CalibrationObservation).where(
        CalibrationObservation.hardware == hardware, CalibrationObservation.excluded_at.is_(None))
        .order_by(CalibrationObservation.id.desc()).limit(MAX_FIT_OBSERVATIONS)))
    if rows:
        result = calibrate(base, [_observation(row) for row in rows])
        profile, constants = result.profile, result.constants
        fit_error = {"before": jsonable(result.before), "after": jsonable(result.after)}
    else:
        profile, constants, fit_error = base, {}, {}
    now = utcnow()
    version = (session.scalar(select(func.max(Calibration.version)).where(Calibration.hardware == hardware)) or 0) + 1
    session.execute(update(Calibration).where(Calibration.hardware == hardware, Calibration.active)
                    .values(active=False))
    calibration = Calibration(hardware=hardware, version=version, created_at=now, created_by=by,
                              observation_ids=sorted(row.id for row in rows), constants=jsonable(constants),
                              fit_error=fit_error, profile=jsonable(profile.to_json()), active=True,
                              activated_at=now, activated_by=by)
    session.add(calibration)
    session.flush()
    return calibration


def profile_for(session: Session, hardware: str, *, refit_if_stale: bool, by: str | None = None):
    """(the profile recommendations and predictions for `hardware` use, its active calibration or None
    for the catalog's). With `refit_if_stale`, an out-of-date version is refitted first (and committed:
    two requests racing to fit the same version leave one, the other reads it)."""
    from locojax.placement.hardware import HARDWARE, HardwareProfile

    if refit_if_stale and stale(session, hardware):
        try:
            refit(session, hardware, by=by or CONTROL_PLANE)
            session.commit()
        except IntegrityError:  # another request fitted this version first
            session.rollback()
    current = active(session, hardware)
    if current is None:
        return HARDWARE.get(hardware), None
    return HardwareProfile.from_json(current.profile), current


def activate(session: Session, calibration_id: int, *, by: str | None) -> Calibration:
    """Make an earlier (or any) version of a hardware's calibration the active one, until its
    observations next change."""
    calibration = get_version(session, calibration_id)
    now = utcnow()
    session.execute(update(Calibration).where(Calibration.hardware == calibration.hardware, Calibration.active,
                                              Calibration.id != calibration.id).values(active=False))
    session.flush()
    calibration.active, calibration.activated_at, calibration.activated_by = True, now, by
    session.commit()
    return calibration


def get_version(session: Session, calibration_id: int) -> Calibration:
    calibration = session.get(Calibration, calibration_id)
    if calibration is None:
        raise NotFoundError(f"calibration {calibration_id} not found", code="CALIBRATION_NOT_FOUND")
    return calibration


def list_versions(session: Session, hardware: str | None) -> list[Calibration]:
    query = select(Calibration)
    if hardware is not None:
        query = query.where(Calibration.hardware == hardware)
    return list(session.scalars(query.order_by(Calibration.hardware, Calibration.version.desc())))


# --- predictions -----------------------------------------------------------------------------------

def _times(estimate) -> dict[str, float | None]:
    from locojax.placement.calibration import predicted_phases

    return jsonable({"step_s": estimate.step_s, **predicted_phases(estimate), "device_s": estimate.device_s,
                     "host_s": estimate.host_s, "network_s": estimate.network_s})


def predict(session: Session, hardware: str, spec: dict[str, Any], model: dict[str, Any], *,
            refit_if_stale: bool) -> tuple[dict[str, Any], Calibration | None]:
    """What the active calibration of `hardware` predicts for a run of `spec` training `model`:
    ({"step_s", phases, split, "calibration_version"} or {"error"}, the calibration used)."""
    from locojax.placement.calibration import StepMeasurement, observation_from_payload
    from locojax.placement.cost_model import InfeasiblePlacement

    profile, calibration = profile_for(session, hardware, refit_if_stale=refit_if_stale)
    unmeasured = StepMeasurement(step_s=1.0, device_s=float("nan"), host_s=float("nan"),
                                 network_s=float("nan"), steps=1)
    observation = observation_from_payload({"spec": spec, "model": model, "measured": unmeasured.to_json()})
    version = calibration.version if calibration is not None else None
    try:
        return {**_times(observation.predict(profile)), "calibration_version": version}, calibration
    except InfeasiblePlacement as exc:
        return {"error": str(exc), "calibration_version": version}, calibration


def predict_run(session: Session, run: Run, hosts: list[Host]) -> None:
    """At reservation: the hosts' hardware profile and what the active calibration predicts for the run
    there, on the run row (its observation carries them when it ends). Never raises: a run starts
    whether or not it can be priced; why not is an event."""
    from locojax.placement.calibration import PRICED_KINDS
    from locojax.placement.memory import spec_model_config
    from locojax.spec import parse_spec

    kinds = sorted({hardware_of_kind(host.device_kind) or f"?{host.device_kind}" for host in hosts})
    hardware = kinds[0] if len(kinds) == 1 and not kinds[0].startswith("?") else None
    run.hardware = hardware
    run.predicted, run.calibration_id = None, None
    if hardware is None:
        events.record(session, run.id, f"not priced: its hosts' hardware is {', '.join(k.lstrip('?') for k in kinds)}"
                      f"{' (not one catalog profile)' if len(kinds) > 1 else ' (not in the catalog)'}",
                      source="placement")
        return
    try:
        spec = parse_spec(dict(run.spec))
        model = dataclasses.asdict(spec_model_config(spec))
    except (OSError, ValueError) as exc:  # a checkpoint this server cannot read
        events.record(session, run.id, f"not priced: the model's dimensions are unknown here ({exc})",
                      source="placement")
        return
    # JAX's own name where the worker asked JAX (what an imported run directory records too).
    device_kind = (hosts[0].info or {}).get("jax_device_kind") or hosts[0].device_kind
    predicted: dict[str, Any] = {"hardware": hardware, "device_kind": str(device_kind)[:64], "model": model}
    if spec.kind in PRICED_KINDS:
        try:
            times, calibration = predict(session, hardware, run.spec, model, refit_if_stale=False)
        except Exception as exc:  # noqa: BLE001 - pricing is advice; the run starts regardless
            log.exception("pricing run %s failed", run.id)
            times, calibration = {"error": f"{type(exc).__name__}: {exc}"}, None
        predicted.update(times)
        run.calibration_id = calibration.id if calibration is not None else None
        if "step_s" in times:
            version = f"calibration v{calibration.version}" if calibration is not None else "catalog constants"
            events.record(session, run.id, f"predicted on {hardware} ({version}): step {times['step_s']:.4g} s = "
                                           f"rollout {times['rollout_s']:.4g} + reward {times['reward_s']:.4g} + "
                                           f"train {times['train_s']:.4g} s", source="placement")
    run.predicted = predicted


# --- observations ----------------------------------------------------------------------------------

def _records(session: Session, run_id: int) -> list[dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    rows = session.execute(select(StepMetric.step, StepMetric.key, StepMetric.value).where(
        StepMetric.run_id == run_id, StepMetric.host == AGGREGATE_HOST, StepMetric.key.in_(MEASURED_KEYS)))
    for step, key, value in rows:
        by_step.setdefault(step, {"step": step, "host": c.ALL_HOSTS})[key] = value
    return [by_step[step] for step in sorted(by_step)]


def record_run(session: Session, run: Run) -> CalibrationObservation | None:
    """The observation a run that just ended makes (or updates, when a resumed run ends again), inside
    the caller's transaction; why a run makes none is an event. Never raises."""
    try:
        with session.begin_nested():
            return _record_run(session, run)
    except Exception:  # noqa: BLE001 - learning from a run must never stop it from ending
        log.exception("recording the observation of run %s failed", run.id)
        return None


def _record_run(session: Session, run: Run) -> CalibrationObservation | None:
    from locojax.placement.calibration import steady_steps_refusal, summarize
    from locojax.spec import parse_spec

    records = _records(session, run.id)
    if not records:
        return None  # it never ran a step
    predicted = run.predicted or {}
    if run.hardware is None or "model" not in predicted:
        why = "its hosts' hardware is unknown" if run.hardware is None else "its model's dimensions are unknown"
        events.record(session, run.id, f"teaches the placement model nothing: {why}", source="placement")
        return None
    spec = parse_spec(dict(run.spec))
    try:
        measured = summarize(records)
    except ValueError:
        return None
    finished = RunStatus(run.status) is RunStatus.SUCCEEDED
    refusal = steady_steps_refusal(spec, measured, finished)
    if refusal is not None:
        events.record(session, run.id, f"teaches the placement model nothing: {refusal}", source="placement")
        return None
    now = utcnow()
    row = session.scalar(select(CalibrationObservation).where(CalibrationObservation.run_id == run.id))
    if row is None:
        row = CalibrationObservation(source="run", run_id=run.id, created_at=now, created_by=CONTROL_PLANE,
                                     predicted=_prediction_part(predicted), calibration_id=run.calibration_id)
        session.add(row)
    row.hardware, row.device_kind = run.hardware, str(predicted.get("device_kind") or run.hardware)
    row.device_count = spec.placement.hosts * spec.placement.devices_per_host
    row.label, row.finished, row.spec, row.model = run.name, finished, run.spec, predicted["model"]
    row.measured, row.measured_at, row.updated_at = measured.to_json(), now, now
    session.flush()
    events.record(session, run.id, f"observation {row.id} for {run.hardware}: measured step {measured.step_s:.4g} s"
                                   + _error_note(row), source="placement")
    return row


def _prediction_part(predicted: dict[str, Any]) -> dict[str, Any] | None:
    times = {key: predicted[key] for key in ("step_s", *PHASE_FIELDS, *SPLIT_FIELDS, "calibration_version")
             if key in predicted}
    return times if "step_s" in times else None


def relative_error(row: CalibrationObservation) -> float | None:
    """(predicted - measured) / measured of the step, where the observation has a prediction."""
    predicted = (row.predicted or {}).get("step_s")
    measured = (row.measured or {}).get("step_s")
    if not predicted or not measured:
        return None
    return (predicted - measured) / measured


def _error_note(row: CalibrationObservation) -> str:
    error = relative_error(row)
    if error is None:
        return " (no prediction before it)"
    return f", predicted {row.predicted['step_s']:.4g} s ({error:+.0%})"


def import_observation(session: Session, body: Any, *, by: str | None) -> tuple[CalibrationObservation, bool]:
    """An observation from a run directory measured elsewhere (`locojax calibration import`). Idempotent
    on the directory's digest: the same run twice is the same observation (created False). Every field
    is checked against what it claims; a refusal is a 422 naming the field."""
    from locojax.placement.calibration import (
        StepMeasurement,
        model_config_from_json,
        observation_from,
        steady_steps_refusal,
    )
    from locojax.placement.hardware import HARDWARE, hardware_for_device

    existing = session.scalar(select(CalibrationObservation).where(CalibrationObservation.digest == body.digest))
    if existing is not None:
        return existing, False
    if body.hardware not in HARDWARE:
        raise InvalidInputError.for_field("hardware", f"unknown hardware {body.hardware!r}; known: "
                                                      f"{', '.join(HARDWARE.names())}", code="OBSERVATION_INVALID")
    kind_is = hardware_for_device(body.device_kind)
    if kind_is is not None and kind_is != body.hardware:
        raise InvalidInputError.for_field("device_kind", f"{body.device_kind!r} is {kind_is}, not {body.hardware}",
                                          code="OBSERVATION_INVALID")
    try:
        model = model_config_from_json(body.model, "model")
        measured = StepMeasurement.from_json(body.measured, "measured")
        observation_from(body.spec, model, measured)
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        raise InvalidInputError.for_field(field, message or str(exc), code="OBSERVATION_INVALID") from None
    refusal = steady_steps_refusal(body.spec, measured, body.finished)
    if refusal is not None:
        raise InvalidInputError.for_field("measured.steps" if "step" in refusal else "spec.kind", refusal,
                                          code="OBSERVATION_REFUSED")
    spec = body.spec.model_dump(mode="json")
    model_json = jsonable(dataclasses.asdict(model))
    predicted, calibration = predict(session, body.hardware, spec, model_json, refit_if_stale=True)
    now = utcnow()
    row = CalibrationObservation(
        hardware=body.hardware, device_kind=body.device_kind, device_count=body.device_count, source="import",
        digest=body.digest, label=body.label, finished=body.finished, spec=spec, model=model_json,
        measured=measured.to_json(), predicted=_prediction_part(predicted),
        calibration_id=calibration.id if calibration is not None else None, measured_at=now, created_at=now,
        created_by=by, updated_at=now)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # the same directory imported concurrently: the other one stands
        session.rollback()
        existing = session.scalar(select(CalibrationObservation).where(CalibrationObservation.digest == body.digest))
        if existing is None:
            raise
        return existing, False
    return row, True


def get_observation(session: Session, observation_id: int) -> CalibrationObservation:
    row = session.get(CalibrationObservation, observation_id)
    if row is None:
        raise NotFoundError(f"observation {observation_id} not found", code="OBSERVATION_NOT_FOUND")
    return row


def list_observations(session: Session, *, hardware: str | None, limit: int, cursor: str | None
                      ) -> tuple[list[CalibrationObservation], str | None]:
    """Newest first, keyset-paginated like the runs."""
    query = select(CalibrationObservation)
    if hardware is not None:
        query = query.where(CalibrationObservation.hardware == hardware)
    return pagination.page(session, query, CalibrationObservation.id, limit=limit, cursor=cursor)


def set_excluded(session: Session, observation_id: int, excluded: bool, *, by: str | None) -> CalibrationObservation:
    """Leave an observation out of (or back in) its hardware's fits; the next fit follows."""
    row = get_observation(session, observation_id)
    if (row.excluded_at is not None) == excluded:
        return row  # already so: repeating is not an error
    now = utcnow()
    row.excluded_at, row.excluded_by = (now, by) if excluded else (None, None)
    row.updated_at = now
    if row.run_id is not None:
        events.record(session, row.run_id, f"observation {row.id} {'excluded from' if excluded else 'included in'} "
                                           f"the {row.hardware} calibration by {by or 'an admin'}", source="placement")
    session.commit()
    return row


def prediction_errors(session: Session, *, limit: int = 2000) -> dict[str, list[tuple[datetime, float, int]]]:
    """Per hardware, (measured at, relative step error, observation id) of every observation that had a
    prediction, oldest first: what the placement page charts."""
    rows = session.scalars(select(CalibrationObservation).where(CalibrationObservation.predicted.is_not(None))
                           .order_by(CalibrationObservation.measured_at.desc()).limit(limit))
    series: dict[str, list[tuple[datetime, float, int]]] = {}
    for row in rows:
        error = relative_error(row)
        if error is not None:
            series.setdefault(row.hardware, []).append((row.measured_at, error, row.id))
    return {hardware: sorted(points) for hardware, points in sorted(series.items())}


def observation_for_run(session: Session, run_id: int) -> CalibrationObservation | None:
    return session.scalar(select(CalibrationObservation).where(CalibrationObservation.run_id == run_id))
