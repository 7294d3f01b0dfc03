"""Keyset pagination cursors: opaque to clients, an id underneath (pages stay stable while rows are added)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from sqlalchemy.orm import Session

from server.errors import InvalidInputError


def encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"v1:{last_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        version, value = raw.split(":", 1)
        last_id = int(value)
        if version != "v1" or last_id < 0:
            raise ValueError
        return last_id
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidInputError.for_field("cursor", "not a cursor returned by this API", code="INVALID_CURSOR") from None


def page(session: Session, query: Any, id_column: Any, *, limit: int, cursor: str | None) -> tuple[list[Any], str | None]:
    """One page of `query`'s rows, newest (highest id) first, and the cursor of the next page (None: the last)."""
    if cursor:
        query = query.where(id_column < decode_cursor(cursor))
    rows = list(session.scalars(query.order_by(id_column.desc()).limit(limit + 1)))
    next_cursor = encode_cursor(rows[limit - 1].id) if len(rows) > limit else None
    return rows[:limit], next_cursor
