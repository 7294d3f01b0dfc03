"""Host inventory: registration, heartbeats, liveness derived from heartbeat age."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import update

from server.models import Host, HostRecordStatus, RunStatus, utcnow
from tests.server.helpers import assert_error, insert_run


def _age(db, name: str, seconds: float, status: HostRecordStatus = HostRecordStatus.ONLINE) -> None:
    with db.write_session() as session:
        session.execute(update(Host).where(Host.name == name).values(
            last_heartbeat=utcnow() - timedelta(seconds=seconds), status=status))
        session.commit()


def test_register_is_idempotent_and_heartbeat_updates(client, db, worker, submitter):
    body = {"name": "host-0", "slice": "local", "device_kind": "cpu", "device_count": 2, "info": {"cores": [0, 1]}}
    first = client.post("/api/v1/hosts", json=body, headers=worker).json()
    again = client.post("/api/v1/hosts", json={**body, "device_count": 4}, headers=worker).json()
    assert (first["status"], again["device_count"], again["registered_at"]) == ("ONLINE", 4, first["registered_at"])
    _age(db, "host-0", 20)
    assert client.get("/api/v1/hosts/host-0", headers=submitter).json()["status"] == "STALE"
    beat = client.post("/api/v1/hosts/host-0/heartbeat", json={"info": {"load": 0.5}}, headers=worker).json()
    assert beat["status"] == "ONLINE" and beat["heartbeat_age_s"] < 5 and beat["info"] == {"load": 0.5}
    # a heartbeat without a body keeps the info
    assert client.post("/api/v1/hosts/host-0/heartbeat", headers=worker).json()["info"] == {"load": 0.5}


@pytest.mark.parametrize(("age", "stored", "shown"), [
    (0, HostRecordStatus.ONLINE, "ONLINE"), (14, HostRecordStatus.ONLINE, "ONLINE"),
    (16, HostRecordStatus.ONLINE, "STALE"), (61, HostRecordStatus.ONLINE, "LOST"), (1, HostRecordStatus.LOST, "LOST"),
])
def test_liveness_is_derived_from_heartbeat_age(client, db, worker, submitter, age, stored, shown):
    client.post("/api/v1/hosts", json={"name": "h"}, headers=worker)
    _age(db, "h", age, stored)
    listed = client.get("/api/v1/hosts", headers=submitter).json()["data"]
    assert [(h["name"], h["status"]) for h in listed] == [("h", shown)]
    assert listed[0]["heartbeat_age_s"] == pytest.approx(age, abs=2)


def test_a_lost_host_comes_back_with_a_heartbeat(client, db, worker):
    client.post("/api/v1/hosts", json={"name": "h"}, headers=worker)
    _age(db, "h", 300, HostRecordStatus.LOST)
    assert client.post("/api/v1/hosts/h/heartbeat", headers=worker).json()["status"] == "ONLINE"


def test_heartbeat_of_an_unknown_host_is_404(client, worker):
    assert_error(client.post("/api/v1/hosts/h-nobody/heartbeat", headers=worker), 404, "HOST_NOT_FOUND")


@pytest.mark.parametrize("body", [{"name": ""}, {"name": "../etc"}, {"name": "h", "device_count": -1},
                                  {"name": "h", "colour": "red"}])
def test_bad_registrations_are_422(client, worker, body):
    assert_error(client.post("/api/v1/hosts", json=body, headers=worker), 422, "VALIDATION_ERROR")


def test_remove_only_unreserved_hosts(client, db, worker, submitter, admin):
    run_id = insert_run(db, RunStatus.RUNNING)
    for name in ("h-free", "h-busy"):
        client.post("/api/v1/hosts", json={"name": name}, headers=worker)
    with db.write_session() as session:
        session.execute(update(Host).where(Host.name == "h-busy").values(reserved_by_run_id=run_id))
        session.commit()
    assert client.get("/api/v1/hosts/h-busy", headers=submitter).json()["reserved_by_run_id"] == run_id
    assert_error(client.delete("/api/v1/hosts/h-busy", headers=worker), 409, "HOST_RESERVED")
    assert client.delete("/api/v1/hosts/h-free", headers=worker).status_code == 204
    assert [h["name"] for h in client.get("/api/v1/hosts", headers=submitter).json()["data"]] == ["h-busy"]
    # the run finishing releases the reservation
    client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": "FAILED"}, headers=admin)
    assert client.get("/api/v1/hosts/h-busy", headers=submitter).json()["reserved_by_run_id"] is None


def test_host_info_is_bounded_to_16_kib(client, db, worker):
    big = {"notes": "x" * (16 * 1024)}
    error = assert_error(client.post("/api/v1/hosts", json={"name": "host-big", "info": big}, headers=worker),
                         422, "VALIDATION_ERROR")
    assert "16384" in json.dumps(error)
    assert client.post("/api/v1/hosts", json={"name": "host-big", "info": {"notes": "x" * 8000}},
                       headers=worker).status_code in (200, 201)
    assert_error(client.post("/api/v1/hosts/host-big/heartbeat", json={"info": big}, headers=worker), 422)
