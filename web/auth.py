"""Dashboard sessions: a login trades an API token for a signed cookie; CSRF tokens guard every form.

The cookie holds `{"csrf", "tid", "exp"}` (the token's row id, never its secret), signed with HMAC-SHA256,
HttpOnly and SameSite=Lax. Every request looks the token row up again, so revoking or expiring the token
ends the dashboard sessions made with it at once. Visitors who are not logged in get a session too (no
`tid`): it carries the CSRF token of the login form. Logging in issues a fresh session, so a CSRF token
seen before login is worthless after it.

Reading needs any valid token (as in the API); changing anything (submit, cancel, resume, ask the
recommender) needs the `submit` scope.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from urllib.parse import quote, urlsplit

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from server.api.deps import SessionDep
from server.errors import ApiError, ForbiddenError
from server.models import ApiToken
from server.services import tokens as token_service
from server.settings import Settings

COOKIE_NAME = "locojax_session"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class LoginRequired(Exception):
    """No valid session: pages redirect to /login, htmx fragments tell the browser to go there."""


class CsrfRejected(ApiError):
    status_code = 403
    code = "CSRF_FAILED"


@dataclass(frozen=True)
class WebSession:
    csrf: str
    token_id: int | None
    expires_at: float


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the API token the session was made with."""

    token_id: int
    name: str
    scopes: frozenset[str]

    @property
    def can_submit(self) -> bool:
        return bool(self.scopes & {"submit", "admin"})


# --- the signing key --------------------------------------------------------------------------------

def signing_key(settings: Settings) -> bytes:
    """The configured secret, else a random key created once under `home` and shared by every process
    that uses that home (so a restart or a second API process does not log everybody out)."""
    if settings.dashboard_secret is not None:
        return hashlib.sha256(settings.dashboard_secret.get_secret_value().encode()).digest()
    path = Path(settings.home) / "dashboard.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):  # another process may have created it an instant ago and not written it yet
            text = path.read_text().strip()
            if text:
                return bytes.fromhex(text)
            time.sleep(0.01)
        raise RuntimeError(f"{path} is empty; delete it to have a new dashboard key made") from None
    key = secrets.token_bytes(32)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(key.hex())
    return key


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_session(key: bytes, web_session: WebSession) -> str:
    payload = _b64(json.dumps({"csrf": web_session.csrf, "tid": web_session.token_id,
                               "exp": int(web_session.expires_at)}, separators=(",", ":")).encode())
    signature = _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())
    return f"{payload}.{signature}"


def decode_session(key: bytes, cookie: str | None, now: float | None = None) -> WebSession | None:
    """The session in a cookie, or None when it is missing, tampered with, malformed or expired."""
    if not cookie or cookie.count(".") != 1 or len(cookie) > 1024:
        return None
    payload, signature = cookie.split(".")
    expected = _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())
    if not hmac.compare_digest(signature, expected):
        return None
    try:
        data = json.loads(_unb64(payload))
        web_session = WebSession(csrf=str(data["csrf"]), token_id=data["tid"], expires_at=float(data["exp"]))
    except (ValueError, KeyError, TypeError):
        return None
    if web_session.token_id is not None and not isinstance(web_session.token_id, int):
        return None
    if web_session.expires_at <= (now if now is not None else time.time()):
        return None
    return web_session


def new_session(settings: Settings, token_id: int | None = None) -> WebSession:
    return WebSession(csrf=secrets.token_urlsafe(32), token_id=token_id,
                      expires_at=time.time() + settings.dashboard_session_ttl_s)


def set_session_cookie(request: Request, response: Response, web_session: WebSession) -> None:
    settings: Settings = request.app.state.settings
    secure = settings.dashboard_secure_cookies
    if secure is None:
        secure = request.url.scheme == "https"
    response.set_cookie(COOKIE_NAME, encode_session(request.app.state.dashboard_key, web_session),
                        max_age=int(web_session.expires_at - time.time()), path="/", httponly=True,
                        samesite="lax", secure=secure)


def clear_session_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE_NAME, path="/", httponly=True, samesite="lax")


# --- dependencies -----------------------------------------------------------------------------------

async def current_session(request: Request) -> WebSession | None:
    web_session = decode_session(request.app.state.dashboard_key, request.cookies.get(COOKIE_NAME))
    request.state.web_session = web_session
    return web_session


def _active_token(session: Session, token_id: int) -> ApiToken | None:
    token = session.get(ApiToken, token_id)
    if token is None or not token_service.is_active(token):
        return None
    return token


def current_viewer(request: Request, session: SessionDep,
                   web_session: Annotated[WebSession | None, Depends(current_session)]) -> Viewer:
    if web_session is None or web_session.token_id is None:
        raise LoginRequired
    token = _active_token(session, web_session.token_id)
    # End this transaction now: the events stream keeps its dependencies (this session) for as long as
    # it runs, and an open transaction would pin a pooled connection (and a snapshot) all that time.
    session.commit()
    if token is None:
        raise LoginRequired
    viewer = Viewer(token_id=token.id, name=token.name, scopes=token.scope_set)
    request.state.viewer = viewer
    return viewer


async def check_csrf(request: Request, web_session: Annotated[WebSession | None, Depends(current_session)]) -> None:
    """Every state-changing request must echo the session's CSRF token (form field or htmx header)."""
    if request.method in _SAFE_METHODS:
        return
    sent = request.headers.get(CSRF_HEADER)
    if not sent:
        form = await request.form()  # Starlette caches it; the route reads the same form again for free
        value = form.get(CSRF_FIELD)
        sent = value if isinstance(value, str) else None
    if web_session is None or not sent or not hmac.compare_digest(sent.encode(), web_session.csrf.encode()):
        raise CsrfRejected("the form's security token is missing or out of date; reload the page and try again")


def require_submit(viewer: Annotated[Viewer, Depends(current_viewer)],
                   _: Annotated[None, Depends(check_csrf)]) -> Viewer:
    """A logged-in viewer whose token may change things, on a request that carries the CSRF token."""
    if not viewer.can_submit:
        raise ForbiddenError("this needs a token with the 'submit' scope; log in with one", code="AUTH_FORBIDDEN")
    return viewer


ViewerDep = Annotated[Viewer, Depends(current_viewer)]
SubmitterDep = Annotated[Viewer, Depends(require_submit)]
WebSessionDep = Annotated[WebSession | None, Depends(current_session)]
CsrfDep = Annotated[None, Depends(check_csrf)]


def safe_next(target: str | None) -> str:
    """Only paths on this site; `//host` and `https://...` would make the login an open redirect."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/runs"
    return target


def login_url(request: Request) -> str:
    """/login?next=<where the reader was>. For an htmx fragment that is the page it sits on (htmx sends
    its address), not the fragment's own URL."""
    current = request.headers.get("HX-Current-URL")
    if current:
        parts = urlsplit(current)
        path = parts.path + ("?" + parts.query if parts.query else "")
    else:
        path = request.url.path + ("?" + request.url.query if request.url.query else "")
    return "/login?next=" + quote(safe_next(path), safe="")
