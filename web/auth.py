"""Dashboard sessions: a login trades an API token for a signed cookie; CSRF tokens guard every form.

The cookie holds `{"csrf", "tid", "sid", "exp"}` (the token's row id, never its secret, and a random
session id whose SHA-256 is a `web_sessions` row), signed with HMAC-SHA256, HttpOnly and SameSite=Lax,
Secure over TLS or behind a proxy that says so. Every request looks both rows up again, so logging out
(the session row is revoked) or revoking or expiring the token ends the session at once. Visitors who are not logged in get a session too (no
`tid`): it carries the CSRF token of the login form. Logging in issues a fresh session, so a CSRF token
seen before login is worthless after it.

Failed logins are rate limited per client address (`LoginLimiter`, in process: each API replica
counts its own).

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
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated
from urllib.parse import quote, urlsplit

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from server.api.deps import SessionDep
from server.errors import ApiError, ForbiddenError
from server.models import ApiToken, Run
from server.services import authorization
from server.services import tokens as token_service
from server.services import web_sessions as web_session_service
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
    session_id: str | None = None  # logged-in sessions only: names the web_sessions row (by its hash)


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the API token the session was made with."""

    token_id: int
    name: str
    scopes: frozenset[str]

    @property
    def can_submit(self) -> bool:
        return bool(self.scopes & {"submit", "admin"})

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def may_act_on(self, run: Run) -> bool:
        """Cancel or resume `run`: the submit scope, then the API's ownership rule (issue 17)."""
        return self.can_submit and authorization.may_act_on_run(self.scopes, self.token_id, run)

    def check_may_act_on(self, run: Run, action: str) -> None:
        """403 RUN_NOT_OWNED, with the API's message and code, unless this viewer may `action` `run`."""
        authorization.check_may_act_on_run(self.scopes, self.token_id, run, action)


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
    payload = _b64(json.dumps({"csrf": web_session.csrf, "tid": web_session.token_id, "sid": web_session.session_id,
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
        web_session = WebSession(csrf=str(data["csrf"]), token_id=data["tid"], expires_at=float(data["exp"]),
                                 session_id=data.get("sid"))
    except (ValueError, KeyError, TypeError):
        return None
    if web_session.token_id is not None and not isinstance(web_session.token_id, int):
        return None
    if web_session.session_id is not None and not isinstance(web_session.session_id, str):
        return None
    if web_session.expires_at <= (now if now is not None else time.time()):
        return None
    return web_session


def new_session(settings: Settings) -> WebSession:
    """An anonymous session: it only carries the login form's CSRF token."""
    return WebSession(csrf=secrets.token_urlsafe(32), token_id=None,
                      expires_at=time.time() + settings.dashboard_session_ttl_s)


def start_login(session: Session, settings: Settings, token: ApiToken) -> WebSession:
    """A fresh logged-in session for `token`, stored as a web_sessions row."""
    web_session = WebSession(csrf=secrets.token_urlsafe(32), token_id=token.id,
                             expires_at=time.time() + settings.dashboard_session_ttl_s,
                             session_id=secrets.token_urlsafe(32))
    assert web_session.session_id is not None
    web_session_service.store(session, web_session.session_id, token.id,
                              datetime.fromtimestamp(web_session.expires_at, timezone.utc))
    return web_session


def end_login(session: Session, web_session: WebSession | None) -> None:
    """Logout: the session's row is revoked, so its cookie is refused from now on, wherever it is kept."""
    if web_session is None or web_session.session_id is None:
        return
    web_session_service.revoke(session, web_session.session_id)


def _live_login(session: Session, web_session: WebSession) -> bool:
    if web_session.session_id is None:
        return False
    return web_session_service.is_live(session, web_session.session_id, web_session.token_id)


def served_over_tls(request: Request, settings: Settings) -> bool:
    """https, seen directly or, when the operator says a proxy terminates TLS in front of us
    (`trust_forwarded_proto`), as the proxy's X-Forwarded-Proto."""
    if request.url.scheme == "https":
        return True
    return settings.trust_forwarded_proto and request.headers.get("x-forwarded-proto", "").lower() == "https"


def set_session_cookie(request: Request, response: Response, web_session: WebSession) -> None:
    settings: Settings = request.app.state.settings
    secure = settings.dashboard_secure_cookies
    if secure is None:
        secure = served_over_tls(request, settings)
    response.set_cookie(COOKIE_NAME, encode_session(request.app.state.dashboard_key, web_session),
                        max_age=int(web_session.expires_at - time.time()), path="/", httponly=True,
                        samesite="lax", secure=secure)


def clear_session_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE_NAME, path="/", httponly=True, samesite="lax")


# --- login rate limit ------------------------------------------------------------------------------

class LoginLimiter:
    """At most `max_failures` failed logins per client address in any `window_s` seconds (a sliding
    window); past that, logins from that address are refused until the oldest failure ages out."""

    def __init__(self, max_failures: int, window_s: float = 60.0, max_clients: int = 100_000):
        self.max_failures, self.window_s, self.max_clients = max_failures, window_s, max_clients
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> deque[float]:
        times = self._failures.get(client, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        return times

    def retry_after(self, client: str, now: float | None = None) -> int | None:
        """Seconds until `client` may try again, or None when it may now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._recent(client, now)
            if len(times) < self.max_failures:
                return None
            return max(1, int(times[0] + self.window_s - now + 0.999))

    def failed(self, client: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if client not in self._failures and len(self._failures) >= self.max_clients:
                # Bounded memory under a spray of addresses: forget clients with no recent failure.
                for name in [name for name, times in self._failures.items() if not self._recent(name, now)]:
                    del self._failures[name]
            times = self._recent(client, now)
            times.append(now)
            self._failures[client] = times


# --- dependencies -----------------------------------------------------------------------------------

async def current_session(request: Request) -> WebSession | None:
    web_session = decode_session(request.app.state.dashboard_key, request.cookies.get(COOKIE_NAME))
    request.state.web_session = web_session
    return web_session


def _active_token(session: Session, token_id: int) -> ApiToken | None:
    token = web_session_service.token_by_id(session, token_id)
    if token is None or not token_service.is_active(token):
        return None
    return token


def current_viewer(request: Request, session: SessionDep,
                   web_session: Annotated[WebSession | None, Depends(current_session)]) -> Viewer:
    if web_session is None or web_session.token_id is None:
        raise LoginRequired
    token = _active_token(session, web_session.token_id) if _live_login(session, web_session) else None
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


def require_admin(viewer: Annotated[Viewer, Depends(current_viewer)],
                  _: Annotated[None, Depends(check_csrf)]) -> Viewer:
    """A logged-in admin, on a request that carries the CSRF token (what the API's admin routes ask)."""
    if not viewer.is_admin:
        raise ForbiddenError("this needs a token with the 'admin' scope; log in with one", code="AUTH_FORBIDDEN")
    return viewer


ViewerDep = Annotated[Viewer, Depends(current_viewer)]
SubmitterDep = Annotated[Viewer, Depends(require_submit)]
AdminDep = Annotated[Viewer, Depends(require_admin)]
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
