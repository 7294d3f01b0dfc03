"""Dependencies shared by the routers, as `Annotated` aliases: `SessionDep`, `SettingsDep`, and one token
alias per scope (`ReadToken`, `SubmitToken`, `WorkerToken`, `AdminToken`)."""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from server.db import Database, session_for
from server.errors import AuthenticationError, InvalidInputError, TooManyRequestsError
from server.models import ApiToken
from server.schemas import ErrorResponse
from server.services import tokens
from server.settings import Settings

API_PREFIX = "/api/v1"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


# Dependencies without I/O are `async def`: FastAPI runs a sync dependency in the thread pool, and
# each of those hops costs more than the work itself. The ones that touch the database stay sync.

async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_db(request: Request) -> Database:
    return request.app.state.db


async def get_session(request: Request) -> AsyncIterator[Session]:
    # Requests that may write get a session that takes SQLite's write lock up front (see server.db).
    # Creating a session does no I/O; closing one that still holds a connection (a read that never
    # committed) rolls back, which is I/O, so that happens off the event loop.
    session = session_for(request.app.state.db, write=request.method not in _SAFE_METHODS)
    try:
        yield session
    finally:
        if session.in_transaction():
            await anyio.to_thread.run_sync(session.close)
        else:
            session.close()


SettingsDep = Annotated[Settings, Depends(get_settings)]
DbDep = Annotated[Database, Depends(get_db)]
SessionDep = Annotated[Session, Depends(get_session)]

_bearer = HTTPBearer(auto_error=False, scheme_name="BearerToken",
                     description="`Authorization: Bearer lcj_...`; create one with `locojax token create`")


async def current_token(request: Request, session: SessionDep, settings: SettingsDep,
                        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> ApiToken:
    if credentials is None:
        raise AuthenticationError("a bearer token is required (Authorization: Bearer <token>)", code="AUTH_REQUIRED")
    cache: tokens.TokenCache = request.app.state.token_cache
    token = cache.get(tokens.hash_secret(credentials.credentials))
    if token is None:
        token = await anyio.to_thread.run_sync(_authenticate, session, credentials.credentials, settings)
        cache.put(token)
    tokens.check_active(token)
    return token


def _authenticate(session: Session, secret: str, settings: Settings) -> ApiToken:
    try:
        return tokens.authenticate(session, secret, touch_interval_s=settings.token_touch_interval_s)
    except OperationalError:
        # Only the last-used timestamp failed to save (SQLite busy); authenticate without it.
        session.rollback()
        return tokens.authenticate(session, secret, touch_interval_s=float("inf"))


def require(scope: str | None) -> Callable[..., Any]:
    async def dependency(token: Annotated[ApiToken, Depends(current_token)]) -> ApiToken:
        if scope is not None:
            tokens.authorize(token, scope)
        return token

    dependency.__name__ = f"require_{scope or 'any'}_token"
    return dependency


ReadToken = Annotated[ApiToken, Depends(require(None))]
SubmitToken = Annotated[ApiToken, Depends(require("submit"))]
WorkerToken = Annotated[ApiToken, Depends(require("worker"))]
AdminToken = Annotated[ApiToken, Depends(require("admin"))]

# Ids are 32-bit in the schema; bounding them here turns an out-of-range id into a 422, not a driver error.
MAX_INT32 = 2**31 - 1
RunId = Annotated[int, Path(ge=1, le=MAX_INT32, description="run id")]

_DESCRIPTIONS = {
    401: "missing, invalid, revoked or expired token",
    403: "the token lacks the scope this operation needs",
    404: "not found",
    409: "conflicts with the current state",
    413: "request too large",
    422: "invalid input; `details` lists each field path and its problem",
    503: "a dependency is unavailable",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error status codes, all with the one error shape."""
    return {code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in codes}


def json_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Like `errors`, for routes whose success media type is not JSON (FastAPI would otherwise document
    their errors under the route's media type)."""
    schema = {"$ref": "#/components/schemas/ErrorResponse"}
    return {code: {"description": _DESCRIPTIONS[code], "content": {"application/json": {"schema": schema}}}
            for code in codes}


# A JSON \u0000 escape that is not itself escaped (an odd run of backslashes before "u0000").
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def _require_utf8(body: bytes) -> None:
    """JSON bodies must be UTF-8 (RFC 8259 §8.1). `json.loads` on bytes would also take UTF-16 and UTF-32,
    which no client of ours sends and which slip past byte-level checks such as the NUL rule below. A raw
    NUL byte never occurs in UTF-8 JSON, and is what UTF-16/32 encodings of ASCII text are full of."""
    if b"\x00" in body or body.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise InvalidInputError.for_field("body", "the body must be UTF-8 JSON (UTF-16 and UTF-32 are refused)")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInputError.for_field("body", f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None


async def reject_nul_characters(request: Request) -> None:
    """PostgreSQL cannot store NUL in text or JSONB; refuse it up front, the same on every backend.

    An app-wide dependency, so every string anywhere in a body or query is covered without each schema
    repeating the rule.
    """
    for name, value in request.query_params.multi_items():
        if "\x00" in value:
            raise InvalidInputError.for_field(name, "NUL characters are not allowed")
    if request.method in ("POST", "PUT", "PATCH"):
        body = await request.body()
        content_type = request.headers.get("content-type", "")
        if body and not content_type.startswith(("application/x-www-form-urlencoded", "multipart/")):
            _require_utf8(body)
        if b"\\u0000" in body and _NUL_ESCAPE.search(body):
            raise InvalidInputError.for_field("body", "strings must not contain NUL (\\u0000) characters")


def source_name(token: ApiToken) -> str:
    """How events and transitions name who reported them."""
    return f"token:{token.name}"[:64]


class StreamSlots:
    """Open event streams (SSE) per token, at most `per_token` at once in this API process: a stream
    holds a connection and polls the database until the run ends, so one token must not open
    thousands. `acquire` raises 429; the stream's generator releases its slot when it ends."""

    def __init__(self, per_token: int):
        self.per_token = per_token
        self._open: dict[int, int] = {}
        self._lock = threading.Lock()

    def acquire(self, token_id: int) -> None:
        with self._lock:
            if self._open.get(token_id, 0) >= self.per_token:
                raise TooManyRequestsError(
                    f"this token already has {self.per_token} event streams open; close one first",
                    code="TOO_MANY_STREAMS", headers={"Retry-After": "5"})
            self._open[token_id] = self._open.get(token_id, 0) + 1

    def release(self, token_id: int) -> None:
        with self._lock:
            left = self._open.get(token_id, 0) - 1
            if left > 0:
                self._open[token_id] = left
            else:
                self._open.pop(token_id, None)

    def open_for(self, token_id: int) -> int:
        with self._lock:
            return self._open.get(token_id, 0)
