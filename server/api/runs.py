"""/api/v1/runs: submit, list, get, cancel, resume, delete; and what workers report about a run."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response, status

from server.api.deps import (
    API_PREFIX,
    MAX_INT32,
    AdminToken,
    ReadToken,
    RunId,
    SessionDep,
    SettingsDep,
    SubmitToken,
    WorkerToken,
    errors,
    source_name,
)
from server.models import RunStatus
from server.schemas import (
    CheckpointReport,
    RunCreate,
    RunHostPublic,
    RunHostsPublic,
    RunHostUpsert,
    RunPublic,
    RunsPublic,
    RunTransition,
)
from server.services import attempts, authorization, host_reports
from server.services import runs as run_service

router = APIRouter(prefix=f"{API_PREFIX}/runs", tags=["runs"], responses=errors(401, 403, 422))

IdempotencyKey = Annotated[
    str | None,
    Header(alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
           description="same key + same body from the same token returns the same run; same key + another body "
                       "is a 409; keys of other tokens are never seen"),
]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunPublic,
             responses={200: {"model": RunPublic, "description": "replay of an earlier request with this Idempotency-Key"},
                        **errors(409)})
def create_run(body: RunCreate, session: SessionDep, settings: SettingsDep, token: SubmitToken, response: Response,
               request: Request, idempotency_key: IdempotencyKey = None) -> RunPublic:
    """Submit a run (QUEUED). Spec errors are 422s naming the field path; nothing is written then."""
    run, created = run_service.create(session, body.spec, settings, idempotency_key=idempotency_key,
                                      created_by=token.name, owner_token_id=token.id)
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/api/v1/runs/{run.id}"
    wake_scheduler(request)
    return RunPublic.model_validate(run)


@router.get("", response_model=RunsPublic)
def list_runs(session: SessionDep, settings: SettingsDep, _: ReadToken,
              status_filter: Annotated[list[RunStatus] | None, Query(alias="status", max_length=8)] = None,
              name: Annotated[str | None, Query(min_length=1, max_length=128,
                                                description="substring, case-insensitive")] = None,
              cursor: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
              limit: Annotated[int | None, Query(ge=1, le=MAX_INT32,
                                                 description="page size; clamped to the server's maximum")] = None,
              ) -> RunsPublic:
    """Newest first. Pass `next_cursor` back as `cursor` for the next page."""
    page_size = min(limit or settings.page_size_default, settings.page_size_max)
    rows, next_cursor = run_service.list_page(session, limit=page_size, cursor=cursor, statuses=status_filter, name=name)
    return RunsPublic(data=[RunPublic.model_validate(run) for run in rows], next_cursor=next_cursor)


@router.get("/{run_id}", response_model=RunPublic, responses=errors(404))
def get_run(run_id: RunId, session: SessionDep, _: ReadToken) -> RunPublic:
    return RunPublic.model_validate(run_service.get(session, run_id))


@router.post("/{run_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=RunPublic,
             responses=errors(404, 409))
def cancel_run(run_id: RunId, session: SessionDep, token: SubmitToken, request: Request) -> RunPublic:
    """QUEUED -> CANCELLED at once; a started run goes CANCELLING and stops at its next step boundary.
    Only the token that submitted the run, or an admin (403 RUN_NOT_OWNED otherwise)."""
    authorization.check_run_owner(token, run_service.get(session, run_id), "cancel")
    run = RunPublic.model_validate(run_service.cancel(session, run_id, by=token.name))
    wake_scheduler(request)
    return run


@router.post("/{run_id}/resume", status_code=status.HTTP_202_ACCEPTED, response_model=RunPublic,
             responses=errors(404, 409))
def resume_run(run_id: RunId, session: SessionDep, token: SubmitToken, request: Request) -> RunPublic:
    """FAILED or CANCELLED -> QUEUED as a new attempt that continues from the last checkpoint.
    Only the token that submitted the run, or an admin (403 RUN_NOT_OWNED otherwise)."""
    authorization.check_run_owner(token, run_service.get(session, run_id), "resume")
    run = RunPublic.model_validate(run_service.resume(session, run_id, by=token.name))
    wake_scheduler(request)
    return run


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               responses=errors(404, 409))
def delete_run(run_id: RunId, session: SessionDep, token: SubmitToken) -> Response:
    """Only finished runs (SUCCEEDED, FAILED, CANCELLED); deletes their metrics and events too. Only the
    token that submitted the run, or an admin (403 RUN_NOT_OWNED otherwise)."""
    authorization.check_run_owner(token, run_service.get(session, run_id), "delete")
    run_service.delete_run(session, run_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def wake_scheduler(request: Request) -> None:
    """Let the scheduler act on a change now rather than at its next interval."""
    scheduler = getattr(request.app.state, "scheduler", None)
    if scheduler is not None:
        scheduler.wake()


# --- worker reports ---------------------------------------------------------------------------------

@router.post("/{run_id}/transitions", response_model=RunPublic, responses=errors(404, 409))
def report_transition(run_id: RunId, body: RunTransition, session: SessionDep, token: AdminToken) -> RunPublic:
    """An operator moves the run along its lifecycle by hand (admin only: workers report their processes,
    and the server derives the run's state from them); re-sending the current state is a no-op."""
    run = run_service.report_transition(session, run_id, body.to, reason=body.reason, expected=body.expected,
                                        source=source_name(token))
    return RunPublic.model_validate(run)


@router.post("/{run_id}/checkpoints", response_model=RunPublic, responses=errors(404, 409))
def report_checkpoint(run_id: RunId, body: CheckpointReport, session: SessionDep, token: WorkerToken) -> RunPublic:
    """Record a saved checkpoint of the current attempt; `last_checkpoint_step` only moves forward."""
    run = run_service.get(session, run_id)
    process = attempts.reporting_process(session, run, token, body.attempt, "checkpoint", body.host_name)
    attempts.check_metrics_process(run, process, "checkpoint")
    return RunPublic.model_validate(run_service.report_checkpoint(session, run_id, body.step, source=source_name(token)))


@router.put("/{run_id}/hosts/{process_index}", response_model=RunHostPublic, responses=errors(404, 409))
def upsert_run_host(run_id: RunId, process_index: Annotated[int, Path(ge=0, le=65535)], body: RunHostUpsert,
                    session: SessionDep, token: WorkerToken, request: Request) -> RunHostPublic:
    """Update the row of one host process (by run, attempt, process index) that the scheduler placed on
    the reporting host; the run follows (all started -> RUNNING, all exited -> SUCCEEDED, one failed ->
    RECOVERING or FAILED). 409 for a row the scheduler did not place or a stale attempt."""
    attempts.check_process_report(session, run_service.get(session, run_id), token, process_index, body.attempt,
                                  body.host_name, body.status)
    row = RunHostPublic.model_validate(host_reports.upsert_host_process(session, run_id, process_index, body))
    wake_scheduler(request)
    return row


@router.get("/{run_id}/hosts", response_model=RunHostsPublic, responses=errors(404))
def list_run_hosts(run_id: RunId, session: SessionDep, _: ReadToken,
                   attempt: Annotated[int | None, Query(ge=0, le=MAX_INT32,
                                                        description="default: the current attempt")] = None,
                   ) -> RunHostsPublic:
    rows = run_service.list_host_processes(session, run_id, attempt)
    return RunHostsPublic(data=[RunHostPublic.model_validate(row) for row in rows])
