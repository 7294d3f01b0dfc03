"""Placement decisions, the catalog, health/readiness and the Prometheus endpoint."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.errors import UnavailableError
from server.models import AGGREGATE_HOST, RunStatus
from server.services import placement as placement_service
from tests.server.helpers import assert_error, insert_run

ASK = {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": 16, "workload": "gsm8k"}


def test_recommend_stores_a_decision(client, submitter):
    response = client.post("/api/v1/placement/recommend", json=ASK, headers=submitter)
    assert response.status_code == 201, response.text
    decision = response.json()
    assert decision["options"] and decision["choice"] == decision["options"][0]
    assert decision["mode"] == decision["choice"]["mode"] in ("sc", "co", "da")
    assert decision["predicted_step_s"] == pytest.approx(decision["choice"]["step_time_s"])
    assert decision["reason"] and decision["created_by"] == "test-submit"
    assert decision["request"]["chips"] == 16 and decision["measured_step_s"] is None
    options = decision["options"]
    assert [o["step_time_s"] for o in options] == sorted(o["step_time_s"] for o in options)  # ranked
    assert client.get(f"/api/v1/placement/decisions/{decision['id']}", headers=submitter).json() == decision


@pytest.mark.parametrize(("change", "field"), [
    ({"model": "gpt-17"}, "model"), ({"hardware": "abacus"}, "hardware"), ({"workload": "chess"}, "workload"),
    ({"chips": 0}, "chips"), ({"chips": 6, "chips_per_host": 4}, ""), ({"colour": "red"}, "colour"),
])
def test_bad_placement_requests_are_422_naming_the_field(client, submitter, change, field):
    response = client.post("/api/v1/placement/recommend", json={**ASK, **change}, headers=submitter)
    error = assert_error(response, 422)
    if field:
        assert field in [item["field"] for item in error["details"]], error
    assert client.get("/api/v1/placement/decisions", headers=submitter).json()["data"] == []


def test_placement_library_unavailable_is_503(client, submitter, monkeypatch):
    def missing():
        raise UnavailableError("the placement library is not available: test", code="PLACEMENT_UNAVAILABLE")

    monkeypatch.setattr(placement_service, "_library", missing)
    assert_error(client.post("/api/v1/placement/recommend", json=ASK, headers=submitter), 503, "PLACEMENT_UNAVAILABLE")


def test_decisions_list_and_the_measured_step_time_of_a_run_that_followed_one(client, db, submitter, worker, admin):
    ids = [client.post("/api/v1/placement/recommend", json={**ASK, "chips": chips}, headers=submitter).json()["id"]
           for chips in (8, 16, 32)]
    page = client.get("/api/v1/placement/decisions", params={"limit": 2}, headers=submitter).json()
    assert [d["id"] for d in page["data"]] == ids[:0:-1]
    rest = client.get("/api/v1/placement/decisions", params={"cursor": page["next_cursor"]}, headers=submitter).json()
    assert [d["id"] for d in rest["data"]] == [ids[0]] and rest["next_cursor"] is None
    assert_error(client.get("/api/v1/placement/decisions/99999", headers=submitter), 404, "DECISION_NOT_FOUND")

    spec = {"name": "follows", "placement": {"mode": "co", "hosts": 2, "decision_id": ids[2]}}
    run = client.post("/api/v1/runs", json={"spec": spec}, headers=submitter).json()
    assert run["decision_id"] == ids[2]
    for state in ("STARTING", "RUNNING"):
        client.post(f"/api/v1/runs/{run['id']}/transitions", json={"to": state}, headers=admin)
    rows = [{"step": s, "host": AGGREGATE_HOST, "values": {"time/step": t}} for s, t in enumerate([5.0, 0.4, 0.5, 0.6])]
    client.post(f"/api/v1/runs/{run['id']}/metrics", json={"rows": rows, "attempt": 0}, headers=admin)
    done = client.post(f"/api/v1/runs/{run['id']}/transitions", json={"to": "SUCCEEDED"}, headers=admin).json()
    assert done["measured_step_s"] == pytest.approx(0.55)
    decision = client.get(f"/api/v1/placement/decisions/{ids[2]}", headers=submitter).json()
    assert decision["measured_step_s"] == pytest.approx(0.55) and decision["measured_run_id"] == run["id"]


def test_catalog(client, submitter):
    models = {m["name"]: m for m in client.get("/api/v1/catalog/models", headers=submitter).json()["data"]}
    assert {"tiny", "small", "qwen3-0.6b", "llama-3.1-8b"} <= set(models)
    assert 0.55e9 < models["qwen3-0.6b"]["params"] < 0.65e9
    hardware = {h["name"]: h for h in client.get("/api/v1/catalog/hardware", headers=submitter).json()["data"]}
    assert {"tpu-v5e", "h100", "local-cpu"} <= set(hardware) and hardware["tpu-v5e"]["attributes"]["peak_flops"] > 0
    workloads = [w["name"] for w in client.get("/api/v1/catalog/workloads", headers=submitter).json()["data"]]
    assert "gsm8k" in workloads
    assert {"arith", "gsm8k"} <= set(client.get("/api/v1/catalog/tasks", headers=submitter).json()["data"])
    assert "gsm8k" in client.get("/api/v1/catalog/rewards", headers=submitter).json()["data"]
    schema = client.get("/api/v1/catalog/spec-schema", headers=submitter).json()
    assert {"rollout", "placement", "model"} <= set(schema["properties"])


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "checks": {"database": "ok", "broker": "ok"}}


def test_readiness_is_503_when_the_broker_or_database_is_unreachable(backend):
    settings = backend.settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0", "readyz_timeout_s": 0.5})
    app = create_app(settings, plugins=False)
    try:
        error = assert_error(TestClient(app).get("/readyz"), 503, "NOT_READY")
        assert error["details"]["database"] == "ok" and error["details"]["broker"].startswith("error")
    finally:
        app.state.db.dispose()
    broken = backend.settings.model_copy(update={
        "database_url": "postgresql+psycopg://postgres@127.0.0.1:1/none", "readyz_timeout_s": 0.5})
    app = create_app(broken, plugins=False)
    try:
        error = assert_error(TestClient(app).get("/readyz"), 503, "NOT_READY")
        assert error["details"]["database"].startswith("error") and error["details"]["broker"] == "ok"
        # any other route answers 503 (retryable), not 500, while the database is down
        response = TestClient(app).get("/api/v1/runs", headers={"Authorization": "Bearer lcj_x"})
        assert_error(response, 503, "DATABASE_UNAVAILABLE")
        assert response.headers["retry-after"]
    finally:
        app.state.db.dispose()


@pytest.mark.redis
def test_readiness_with_the_local_redis(backend):
    settings = backend.settings.model_copy(update={"broker_url": "redis://127.0.0.1:6379/0"})
    app = create_app(settings, plugins=False)
    try:
        response = TestClient(app).get("/readyz")
        if response.status_code == 503 and response.json()["error"]["details"]["broker"] != "ok":
            pytest.skip("no Redis on 127.0.0.1:6379")
        assert response.status_code == 200
    finally:
        app.state.db.dispose()


def test_embedded_broker_is_checked_through_kombu(backend, tmp_path):
    settings = backend.settings.model_copy(update={"broker_url": f"sqla+sqlite:///{tmp_path / 'broker.db'}"})
    app = create_app(settings, plugins=False)
    try:
        assert TestClient(app).get("/readyz").json()["checks"]["broker"] == "ok"
    finally:
        app.state.db.dispose()


def test_prometheus_metrics(client, db, submitter, worker):
    run_id = insert_run(db, RunStatus.RUNNING)
    client.post(f"/api/v1/runs/{run_id}/metrics", json={"rows": [{"step": 1, "values": {"a": 1.0, "b": 2.0}}]},
                headers=worker)
    client.get(f"/api/v1/runs/{run_id}", headers=submitter)
    assert_error(client.get("/metrics"), 401)
    text = client.get("/metrics", headers=submitter).text
    assert 'locojax_http_requests_total{method="GET",route="/api/v1/runs/{run_id}",status="200"}' in text
    assert "locojax_metric_values_ingested_total" in text
    assert 'locojax_runs{status="RUNNING"} 1.0' in text
    assert 'locojax_http_request_duration_seconds_bucket' in text
