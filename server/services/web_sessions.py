"""Dashboard logins as `web_sessions` rows (the cookie holds only the session id; its hash keys the
row), so a logout or an expiry is refused wherever the cookie is kept. Used by web/auth.py."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from sqlalchemy import delete
from sqlalchemy.orm import Session

from server.models import ApiToken, WebSession


def session_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def store(session: Session, session_id: str, token_id: int, expires_at: datetime) -> None:
    """Record a fresh login; expired ones are cleared away on the way, so the table stays small."""
    now = datetime.now(timezone.utc)
    session.execute(delete(WebSession).where(WebSession.expires_at < now))
    session.add(WebSession(id_hash=session_hash(session_id), token_id=token_id, expires_at=expires_at))


def revoke(session: Session, session_id: str) -> None:
    row = session.get(WebSession, session_hash(session_id))
    if row is not None and row.revoked_at is None:
        row.revoked_at = datetime.now(timezone.utc)


def is_live(session: Session, session_id: str, token_id: int | None) -> bool:
    """The login exists, is not revoked or expired, and belongs to `token_id`."""
    row = session.get(WebSession, session_hash(session_id))
    return (row is not None and row.revoked_at is None and row.token_id == token_id
            and row.expires_at > datetime.now(timezone.utc))


def token_by_id(session: Session, token_id: int) -> ApiToken | None:
    return session.get(ApiToken, token_id)
