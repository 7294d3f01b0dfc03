"""/api/v1/hosts: workers register and heartbeat; anyone with a token lists them with their liveness."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response, status

from server.api.deps import API_PREFIX, ReadToken, SessionDep, SettingsDep, WorkerToken, errors
from server.schemas import HostHeartbeat, HostName, HostPublic, HostRegister, HostsPublic
from server.services import authorization
from server.services import hosts as host_service

router = APIRouter(prefix=f"{API_PREFIX}/hosts", tags=["hosts"], responses=errors(401, 403, 422))

HostNamePath = Annotated[HostName, Path()]


@router.post("", response_model=HostPublic, responses=errors(409))
def register_host(body: HostRegister, session: SessionDep, settings: SettingsDep, token: WorkerToken) -> HostPublic:
    """Idempotent; a worker calls it on every start. Counts as a heartbeat. Only for a host the token is
    bound to (403 HOST_NOT_BOUND); 409 HOST_IN_USE while another worker instance still heartbeats it."""
    authorization.check_host(token, body.name)
    host_service.check_takeover(session, body, settings)
    return host_service.to_public(host_service.register(session, body), settings)


@router.post("/{name}/heartbeat", response_model=HostPublic, responses=errors(404, 409))
def heartbeat(name: HostNamePath, session: SessionDep, settings: SettingsDep, token: WorkerToken,
              body: HostHeartbeat | None = None) -> HostPublic:
    """404 for an unknown host: the worker registers again (e.g. after the database was reset). 409
    HOST_IN_USE for an `info.instance` other than the registered worker's."""
    authorization.check_host(token, name)
    return host_service.to_public(host_service.heartbeat(session, name, body.info if body else None), settings)


@router.get("", response_model=HostsPublic)
def list_hosts(session: SessionDep, settings: SettingsDep, _: ReadToken) -> HostsPublic:
    return HostsPublic(data=[host_service.to_public(host, settings) for host in host_service.list_all(session)])


@router.get("/{name}", response_model=HostPublic, responses=errors(404))
def get_host(name: HostNamePath, session: SessionDep, settings: SettingsDep, _: ReadToken) -> HostPublic:
    return host_service.to_public(host_service.get(session, name), settings)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response, responses=errors(404, 409))
def remove_host(name: HostNamePath, session: SessionDep, token: WorkerToken) -> Response:
    """Deregister a host that holds no reservation (a worker shutting down cleanly)."""
    authorization.check_host(token, name)
    host_service.remove(session, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
