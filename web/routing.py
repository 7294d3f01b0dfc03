"""The dashboard's route class: errors become HTML pages (or fragments), not the API's JSON.

The app's exception handlers answer in the API's error shape, which suits API clients and nobody
reading a page. `DashboardRoute` catches the same errors (raised by the services or by dependencies)
around each dashboard route: a missing login redirects to /login, anything else renders `error.html`
with the error's status code. htmx requests get `HX-Redirect` instead of a redirect, since htmx would
otherwise follow the redirect and swap the login page into a fragment.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.responses import RedirectResponse, Response

from server.errors import ApiError
from web.auth import LoginRequired, login_url
from web.templating import is_htmx, render


def login_redirect(request: Request) -> Response:
    target = login_url(request)
    if is_htmx(request):
        return Response(status_code=401, headers={"HX-Redirect": target})
    return RedirectResponse(target, status_code=303)


def error_page(request: Request, status_code: int, message: str, code: str = "") -> Response:
    template = "_error.html" if is_htmx(request) else "error.html"
    return render(request, template, status_code=status_code, status=status_code, message=message, code=code)


class DashboardRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except LoginRequired:
                return login_redirect(request)
            except ApiError as exc:
                status_code = exc.status_code
                if status_code == 404 and request.method == "GET" and is_htmx(request):
                    # A polling partial whose run was deleted: 286 is htmx's "stop polling"; the
                    # fragment still replaces the widget, saying why it stopped.
                    status_code = 286
                return error_page(request, status_code, exc.message, exc.code)
            except RequestValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in error.get('loc', ()))}: {error.get('msg')}"
                                     for error in exc.errors())
                return error_page(request, 422, f"invalid request: {problems}", "VALIDATION_ERROR")

        return guarded


def dashboard_router() -> APIRouter:
    # Not part of the API's OpenAPI document: these answer HTML to browsers.
    return APIRouter(route_class=DashboardRoute, include_in_schema=False)
