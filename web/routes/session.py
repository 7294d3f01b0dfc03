"""Login with an API token, and logout. Both are forms with CSRF tokens, like every other form."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from sqlalchemy.exc import OperationalError
from starlette.responses import RedirectResponse, Response

from server.api.deps import SessionDep, SettingsDep
from server.errors import AuthenticationError
from server.services import tokens as token_service
from web.auth import CsrfDep, WebSessionDep, clear_session_cookie, new_session, safe_next, set_session_cookie
from web.routing import dashboard_router
from web.templating import render

router = dashboard_router()


@router.get("/login")
def login_page(request: Request, settings: SettingsDep, web_session: WebSessionDep,
               next: Annotated[str, Query(max_length=2048)] = "") -> Response:
    # Visitors without a session get an anonymous one: it carries the login form's CSRF token.
    if web_session is None:
        web_session = new_session(settings)
        request.state.web_session = web_session
    response = render(request, "login.html", next=safe_next(next), error=None)
    set_session_cookie(request, response, web_session)
    return response


@router.post("/login")
async def login(request: Request, session: SessionDep, settings: SettingsDep, _: CsrfDep) -> Response:
    form = await request.form()
    secret = str(form.get("token", "")).strip()
    target = safe_next(str(form.get("next", "")))
    try:
        token = token_service.authenticate(session, secret, touch_interval_s=settings.token_touch_interval_s)
    except AuthenticationError:
        return render(request, "login.html", status_code=401, next=target,
                      error="That token is not valid (unknown, revoked or expired).")
    except OperationalError:  # only the last-used stamp failed to save (SQLite busy); the token is fine
        session.rollback()
        token = token_service.authenticate(session, secret, touch_interval_s=float("inf"))
    # A fresh session (new CSRF token) at the moment of login: nothing learnt before it is any use after.
    response = RedirectResponse(target, status_code=303)
    set_session_cookie(request, response, new_session(settings, token.id))
    return response


@router.post("/logout")
def logout(_: CsrfDep) -> Response:
    response = RedirectResponse("/login", status_code=303)
    clear_session_cookie(response)
    return response
