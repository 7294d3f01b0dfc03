"""Helpers shared by the control-plane tests."""

from __future__ import annotations

from typing import Any

from server.db import Database
from server.models import HostProcessStatus, HostRole, Run, RunHost, RunStatus


def insert_run(db: Database, status: RunStatus = RunStatus.QUEUED, *, placed_on: str | None = None,
               **fields: Any) -> int:
    """A run placed straight into `status` (test setup only; real code goes through transitions).

    `placed_on`: a host name; its process 0 of the current attempt is placed there (RUNNING), as the
    scheduler would, so that host's worker token may report for the run."""
    with db.write_session() as session:
        run = Run(name=fields.pop("name", "test-run"), spec=fields.pop("spec", {"name": "test-run"}),
                  spec_digest=fields.pop("spec_digest", "0" * 64), status=status, mode=fields.pop("mode", "co"),
                  hosts_needed=fields.pop("hosts_needed", 1), max_restarts=fields.pop("max_restarts", 2),
                  cancel_requested=fields.pop("cancel_requested", status is RunStatus.CANCELLING), **fields)
        session.add(run)
        session.flush()
        if placed_on is not None:
            session.add(RunHost(run_id=run.id, attempt=run.attempt or 0, process_index=0, host_name=placed_on,
                                role=HostRole.CO, status=HostProcessStatus.RUNNING))
        session.commit()
        return run.id


def assert_error(response: Any, status: int, code: str | None = None) -> dict[str, Any]:
    """The response is an error of the documented shape (and code, if given)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]
