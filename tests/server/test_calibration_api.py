"""The placement model learns from measured runs: imported run directories and runs that finish here become
observations, each hardware's calibration is refitted from them in numbered versions that recommendations
and runs name, and an admin can exclude an observation or return to an earlier version."""

from __future__ import annotations

import pytest
from sqlalchemy import select, text

from locojax import contract as c
from locojax.placement.calibration import observation_payload
from server.models import (
    AGGREGATE_HOST,
    CalibrationObservation,
    Host,
    HostRecordStatus,
    Run,
    RunEvent,
    RunStatus,
    StepMetric,
    utcnow,
)
from server.services import runs as run_service
from server.services import scheduling
from tests.placement_runs import SMALL_RUNS, TRUE_V5E, spec_dict, true_times, write_run_dir
from tests.server.helpers import assert_error, insert_run

S = RunStatus
OBSERVATIONS = "/api/v1/calibration/observations"
VERSIONS = "/api/v1/calibration/versions"
RECOMMEND = {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": 1, "chips_per_host": 1, "workload": "gsm8k",
             "prompts_per_step": 16, "group_size": 8, "prompt_len": 64, "gen_len": 128}


@pytest.fixture(autouse=True)
def no_calibrations(db):
    with db.engine.begin() as connection:
        for table in ("calibration_observations", "calibrations"):
            connection.execute(text(f"DELETE FROM {table}"))


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    """What `locojax calibration import` sends for each small-model TPU run directory."""
    root = tmp_path_factory.mktemp("runs")
    return [observation_payload(write_run_dir(root / spec["name"], spec)) for spec in SMALL_RUNS]


def _import(client, headers, payload, status=201):
    response = client.post(OBSERVATIONS, json=payload, headers=headers)
    assert response.status_code == status, response.text
    return response.json()


def test_import_is_for_admins_checked_field_by_field_and_idempotent(client, admin, submitter, payloads):
    payload = payloads[0]
    assert_error(client.post(OBSERVATIONS, json=payload, headers=submitter), 403)
    first = _import(client, admin, payload)
    assert first["created"] is True
    observation = first["observation"]
    assert (observation["hardware"], observation["device_kind"], observation["source"]) == \
        ("tpu-v5e", "TPU v5 lite", "import")
    assert observation["measured"]["step_s"] == pytest.approx(true_times(SMALL_RUNS[0], TRUE_V5E)["step_s"])
    # Priced before it joined, with the catalog's constants: the error the placement page charts.
    assert observation["predicted"]["calibration_version"] is None and observation["rel_error"] is not None
    assert first["calibration"]["version"] == 1 and first["calibration"]["observation_ids"] == [observation["id"]]
    again = _import(client, admin, payload, status=200)
    assert again["created"] is False and again["observation"]["id"] == observation["id"]

    for change, field in (
        ({"hardware": "tpu-v9"}, "hardware"),
        ({"device_kind": "NVIDIA H100 80GB HBM3"}, "device_kind"),
        ({"measured": {**payload["measured"], "step_s": -1.0}}, "measured.step_s"),
        ({"measured": {**payload["measured"], "steps": 0}}, "measured.steps"),
        ({"model": {**payload["model"], "d_model": 0}}, "model"),
        ({"model": {**payload["model"], "colour": "red"}}, "model"),
        ({"digest": "not-a-digest"}, "digest"),
        ({"spec": {**payload["spec"], "steps": "many"}}, "spec.steps"),
    ):
        body = {**payload, "digest": "f" * 64, **change}
        error = assert_error(client.post(OBSERVATIONS, json=body, headers=admin), 422)
        assert any(str(item.get("field", "")).startswith(field) for item in error["details"]), (field, error)
    unfinished = {**payload, "digest": "e" * 64, "finished": False, "measured": {**payload["measured"], "steps": 2}}
    error = assert_error(client.post(OBSERVATIONS, json=unfinished, headers=admin), 422, "OBSERVATION_REFUSED")
    assert "needs at least 3" in error["message"]


def test_refits_learn_and_recommendations_name_their_calibration(client, admin, submitter, payloads):
    before = client.post("/api/v1/placement/recommend", json=RECOMMEND, headers=submitter).json()
    assert before["calibration_id"] is None  # no observation yet: the catalog's constants
    versions = [_import(client, admin, payload)["calibration"] for payload in payloads]
    assert [v["version"] for v in versions] == list(range(1, len(payloads) + 1))
    latest = versions[-1]
    assert len(latest["observation_ids"]) == len(payloads) and latest["active"]
    assert latest["fit_error"]["after"]["step"] < 0.01 < latest["fit_error"]["before"]["step"]
    listed = client.get(VERSIONS, params={"hardware": "tpu-v5e"}, headers=submitter).json()["data"]
    assert [v["active"] for v in listed] == [True] + [False] * (len(payloads) - 1)

    after = client.post("/api/v1/placement/recommend", json=RECOMMEND, headers=submitter).json()
    assert after["calibration_id"] == latest["id"]
    co = next(o for o in after["options"] if o["mode"] == "co")
    truth = true_times(spec_dict("q", "qwen3-0.6b", 16, 8, 64, 128, dtype="bfloat16", remat="full", task="gsm8k"),
                       TRUE_V5E)
    shipped = next(o for o in before["options"] if o["mode"] == "co")
    # The recommender prices the profile's engine (its own decode and FLOP defaults), so it is not the
    # observation's figure; it moves from the catalog's towards what the chip showed.
    assert abs(co["step_time_s"] - truth["step_s"]) < abs(shipped["step_time_s"] - truth["step_s"])


def test_an_admin_excludes_an_observation_or_returns_to_an_earlier_version(client, admin, submitter, payloads):
    for payload in payloads[:3]:
        _import(client, admin, payload)
    observations = client.get(OBSERVATIONS, params={"hardware": "tpu-v5e"}, headers=submitter).json()["data"]
    newest = observations[0]["id"]
    assert_error(client.post(f"{OBSERVATIONS}/{newest}/exclude", headers=submitter), 403)
    excluded = client.post(f"{OBSERVATIONS}/{newest}/exclude", headers=admin).json()
    assert excluded["excluded_by"] == "test-admin"
    decision = client.post("/api/v1/placement/recommend", json=RECOMMEND, headers=submitter).json()
    refitted = client.get(f"{VERSIONS}/{decision['calibration_id']}", headers=submitter).json()
    assert refitted["version"] == 4 and newest not in refitted["observation_ids"]

    assert_error(client.post(f"{VERSIONS}/1/activate", headers=submitter), 403)
    first = client.get(VERSIONS, params={"hardware": "tpu-v5e"}, headers=submitter).json()["data"][-1]
    assert first["version"] == 1
    activated = client.post(f"{VERSIONS}/{first['id']}/activate", headers=admin).json()
    assert activated["active"] and activated["activated_by"] == "test-admin"
    # It stays in use (no refit undoes it) until the observations change again.
    decision = client.post("/api/v1/placement/recommend", json=RECOMMEND, headers=submitter).json()
    assert decision["calibration_id"] == first["id"]
    client.post(f"{OBSERVATIONS}/{newest}/include", headers=admin)
    decision = client.post("/api/v1/placement/recommend", json=RECOMMEND, headers=submitter).json()
    current = client.get(f"{VERSIONS}/{decision['calibration_id']}", headers=submitter).json()
    assert current["version"] == 5 and newest in current["observation_ids"]
    assert_error(client.post(f"{VERSIONS}/999999/activate", headers=admin), 404, "CALIBRATION_NOT_FOUND")
    assert_error(client.post(f"{OBSERVATIONS}/999999/exclude", headers=admin), 404, "OBSERVATION_NOT_FOUND")


def _tpu_host(db, name="h0"):
    with db.write_session() as session:
        session.add(Host(name=name, device_kind="tpu-v5e", device_count=1, status=HostRecordStatus.ONLINE,
                         last_heartbeat=utcnow(), info={}))
        session.commit()


def _finish(backend, run_id, steady_steps: int, status: RunStatus, step_s: float = 0.5):
    with backend.db.write_session() as session:
        rows = [StepMetric(run_id=run_id, key=key, host=AGGREGATE_HOST, step=step,
                           value=(30.0 if step == 0 else 1.0) * value)
                for step in range(steady_steps + 1)
                for key, value in ((c.TIME_STEP, step_s), (c.TIME_ROLLOUT, 0.3), (c.TIME_TRAIN, 0.15),
                                   (c.TIME_REWARD, 0.01))]
        session.add_all(rows)
        run = session.get(Run, run_id)
        run_service.transition(session, run, S.RUNNING)
        run_service.transition(session, run, status)
        session.commit()


def _events(db, run_id):
    with db.read_session() as session:
        return [e.message for e in session.scalars(select(RunEvent).where(RunEvent.run_id == run_id))]


@pytest.mark.parametrize("status, steady, learns", [(S.SUCCEEDED, 1, True), (S.FAILED, 2, False),
                                                    (S.FAILED, 3, True)])
def test_a_finished_run_teaches_the_model_through_its_hosts_hardware(backend, status, steady, learns):
    _tpu_host(backend.db)
    spec = spec_dict("r", "small", 8, 8, 64, 64, steps=10)
    run_id = insert_run(backend.db, spec=spec, name="r")
    with backend.db.write_session() as session:
        scheduling.tick(session, backend.settings)
    with backend.db.read_session() as session:
        run = session.get(Run, run_id)
        assert run.status is S.STARTING and run.hardware == "tpu-v5e" and run.calibration_id is None
        predicted = run.predicted
    assert predicted["step_s"] == pytest.approx(true_times(spec, backend_profile())["step_s"])
    _finish(backend, run_id, steady, status)
    with backend.db.read_session() as session:
        row = session.scalar(select(CalibrationObservation).where(CalibrationObservation.run_id == run_id))
    if not learns:
        assert row is None
        assert any("teaches the placement model nothing" in m and "needs at least 3" in m
                   for m in _events(backend.db, run_id))
        return
    assert row.hardware == "tpu-v5e" and row.finished is (status is S.SUCCEEDED)
    assert row.measured["step_s"] == pytest.approx(0.5) and row.measured["rollout_s"] == pytest.approx(0.3)
    assert row.measured["steps"] == steady
    assert row.predicted["step_s"] == pytest.approx(predicted["step_s"])
    assert any(m.startswith(f"observation {row.id} for tpu-v5e") for m in _events(backend.db, run_id))


def backend_profile():
    from locojax.placement.hardware import HARDWARE

    return HARDWARE.get("tpu-v5e")


def test_hosts_register_their_hardware_and_memory(client, worker, submitter):
    body = {"name": "h7", "device_kind": "tpu-v5e", "device_count": 1, "device_memory_bytes": 16 * 2**30}
    assert client.post("/api/v1/hosts", json=body, headers=worker).status_code == 200
    host = client.get("/api/v1/hosts/h7", headers=submitter).json()
    assert (host["hardware"], host["device_memory_bytes"]) == ("tpu-v5e", 16 * 2**30)
    # An older worker's JAX name maps too; a name outside the catalog has no profile.
    client.post("/api/v1/hosts", json={**body, "name": "h8", "device_kind": "TPU v5 lite"}, headers=worker)
    client.post("/api/v1/hosts", json={**body, "name": "h9", "device_kind": "tpu"}, headers=worker)
    hosts = {h["name"]: h["hardware"] for h in client.get("/api/v1/hosts", headers=submitter).json()["data"]}
    assert (hosts["h8"], hosts["h9"]) == ("tpu-v5e", None)
