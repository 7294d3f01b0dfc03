"""Keyset pagination cursors: opaque to clients, an id underneath (pages stay stable while rows are added)."""

from __future__ import annotations

import base64
import binascii

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
