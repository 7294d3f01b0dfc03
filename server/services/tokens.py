"""API tokens: creation, authentication, revocation.

A token is `lcj_` + 32 random bytes (URL-safe base64). Only its SHA-256 is stored: the secret has 256
bits of entropy, so a plain fast hash is enough (a slow password hash protects low-entropy secrets) and
lookup stays one indexed query. The secret is returned once, at creation, and never logged.

Scopes: `submit` (create runs, and cancel, resume, delete the runs it created; ask the recommender),
`worker` (as the host(s) it is bound to: register, heartbeat, report its processes' metrics, events
and checkpoints), `admin` (everything, including tokens and moving runs by hand). Any valid token
may read.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.errors import AuthenticationError, ForbiddenError, NotFoundError
from server.models import ApiToken, utcnow

SCOPES = ("submit", "worker", "admin")
TOKEN_PREFIX = "lcj_"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create(session: Session, *, name: str, scopes: Iterable[str], expires_in_s: float | None = None,
           hosts: str | None = None) -> tuple[ApiToken, str]:
    """Store a new token; returns (row, secret). The caller shows the secret once.

    A worker token must name the host (or `prefix*` of hosts) it acts as (`hosts`); see
    `services.authorization`. Raises ValueError (bad scopes) or InvalidInputError (bad `hosts`).
    """
    from server.services.authorization import check_host_binding

    scope_list = sorted(set(scopes))
    unknown = [scope for scope in scope_list if scope not in SCOPES]
    if not scope_list or unknown:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}; got {', '.join(scope_list) or 'none'}")
    hosts = check_host_binding(hosts, set(scope_list))
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(
        name=name, prefix=secret[:8], token_hash=hash_secret(secret), scopes=" ".join(scope_list), hosts=hosts,
        expires_at=utcnow() + timedelta(seconds=expires_in_s) if expires_in_s else None,
    )
    session.add(token)
    session.commit()
    return token, secret


def authenticate(session: Session, secret: str, *, touch_interval_s: float = 60.0) -> ApiToken:
    """The token behind `secret`, or AuthenticationError. Never puts the secret into an error.

    The returned row is detached from `session`, so it can be cached and read from other threads.
    """
    token = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_secret(secret)))
    if token is None:
        raise AuthenticationError("invalid token", code="AUTH_INVALID")
    check_active(token)
    # Recording every use would add a write to every request (metric ingest included); minute
    # resolution is what an admin auditing stale tokens needs.
    now = utcnow()
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() >= touch_interval_s:
        token.last_used_at = now
        session.commit()
    session.expunge(token)
    return token


def check_active(token: ApiToken) -> None:
    if token.revoked_at is not None:
        raise AuthenticationError("token revoked", code="AUTH_INVALID")
    if token.expires_at is not None and token.expires_at <= utcnow():
        raise AuthenticationError("token expired", code="AUTH_INVALID")


class TokenCache:
    """Tokens that authenticated in the last `ttl_s` seconds, by hash, so that most requests skip the
    database lookup (and the thread hop it needs).

    Expiry is re-checked on every use. A revocation through this process's API clears the cache at once;
    one made elsewhere (the CLI, another API process) takes effect within `ttl_s`. Unknown tokens are
    never cached.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, ApiToken]] = {}
        self._lock = threading.Lock()

    def get(self, token_hash: str) -> ApiToken | None:
        if self.ttl_s <= 0:
            return None
        with self._lock:
            entry = self._entries.get(token_hash)
        if entry is None or time.monotonic() - entry[0] > self.ttl_s:
            return None
        return entry[1]

    def put(self, token: ApiToken) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[token.token_hash] = (time.monotonic(), token)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def authorize(token: ApiToken, scope: str) -> None:
    granted = token.scope_set
    if "admin" not in granted and scope not in granted:
        raise ForbiddenError(f"this operation needs a token with the '{scope}' scope",
                             code="AUTH_FORBIDDEN", details={"required_scope": scope, "token_scopes": sorted(granted)})


def list_all(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def revoke(session: Session, token_id: int) -> ApiToken:
    token = session.get(ApiToken, token_id)
    if token is None:
        raise NotFoundError(f"token {token_id} not found", code="TOKEN_NOT_FOUND")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
    return token


def ensure_admin(session: Session, *, name: str = "bootstrap-admin") -> str | None:
    """First start: create an admin token if no usable one exists; returns its secret, else None."""
    now = utcnow()
    for token in session.scalars(select(ApiToken).where(ApiToken.revoked_at.is_(None))):
        if "admin" in token.scope_set and (token.expires_at is None or token.expires_at > now):
            return None
    _, secret = create(session, name=name, scopes=["admin"])
    return secret


def is_active(token: ApiToken, now: datetime | None = None) -> bool:
    now = now or utcnow()
    return token.revoked_at is None and (token.expires_at is None or token.expires_at > now)
