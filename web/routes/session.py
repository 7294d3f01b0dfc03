"""Login with an API token, and logout. Both are forms with CSRF tokens, like every other form."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import Query, Request
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from starlette.responses import RedirectResponse, Response

from server.api.deps import SessionDep, SettingsDep
from server.errors import AuthenticationError
from server.services import tokens as token_service
from server.settings import Settings
from web.auth import (CsrfDep, WebSession, WebSessionDep, clear_session_cookie, end_login, new_session, safe_next,
                      set_session_cookie, start_login)
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
    form = await request.form()  # parsed on the loop (CsrfDep already did); the database work is not
    secret = str(form.get("token", ""))[:4096].strip()
    target = safe_next(str(form.get("next", ""))[:2048])
    limiter = request.app.state.login_limiter
    client = request.client.host if request.client else "unknown"
    wait_s = limiter.retry_after(client)
    if wait_s is not None:
        response = render(request, "login.html", status_code=429, next=target,
                          error=f"Too many failed logins from your address; try again in {wait_s} s.")
        response.headers["Retry-After"] = str(wait_s)
        return response
    web_session = await anyio.to_thread.run_sync(_log_in, session, settings, secret)
    if web_session is None:
        limiter.failed(client)
        return render(request, "login.html", status_code=401, next=target,
                      error="That token is not valid (unknown, revoked or expired).")
    # A fresh session (new CSRF token) at the moment of login: nothing learnt before it is any use after.
    response = RedirectResponse(target, status_code=303)
    set_session_cookie(request, response, web_session)
    return response


def _log_in(session: Session, settings: Settings, secret: str) -> WebSession | None:
    """The token's new dashboard session (stored), or None when the token is not valid."""
    try:
        api_token = token_service.authenticate(session, secret, touch_interval_s=settings.token_touch_interval_s)
    except AuthenticationError:
        return None
    except OperationalError:  # only the last-used stamp failed to save (SQLite busy); the token is fine
        session.rollback()
        api_token = token_service.authenticate(session, secret, touch_interval_s=float("inf"))
    web_session = start_login(session, settings, api_token)
    session.commit()
    return web_session


@router.post("/logout")
def logout(session: SessionDep, web_session: WebSessionDep, _: CsrfDep) -> Response:
    end_login(session, web_session)
    session.commit()
    response = RedirectResponse("/login", status_code=303)
    clear_session_cookie(response)
    return response
