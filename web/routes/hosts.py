"""The hosts page: the inventory with liveness from heartbeat age, refreshed while it is open."""

from __future__ import annotations

from fastapi import Request
from starlette.responses import Response

from server.api.deps import SessionDep, SettingsDep
from server.models import utcnow
from server.services import hosts as host_service
from web.auth import ViewerDep
from web.routing import dashboard_router
from web.templating import is_htmx, render

router = dashboard_router()


@router.get("/hosts")
def hosts_page(request: Request, session: SessionDep, settings: SettingsDep, _: ViewerDep) -> Response:
    now = utcnow()
    hosts = [host_service.to_public(host, settings, now) for host in host_service.list_all(session)]
    return render(request, "_hosts_table.html" if is_htmx(request) else "hosts.html", hosts=hosts)
