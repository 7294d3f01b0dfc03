"""/api/v1/tokens (admin): create, list, revoke; /api/v1/whoami for any token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response, status

from server.api.deps import API_PREFIX, MAX_INT32, AdminToken, ReadToken, SessionDep, errors
from server.schemas import TokenCreate, TokenCreated, TokenPublic, TokensPublic
from server.services import tokens as token_service

router = APIRouter(prefix=API_PREFIX, tags=["tokens"], responses=errors(401, 403, 422))


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(body: TokenCreate, session: SessionDep, _: AdminToken) -> TokenCreated:
    """The secret is in this response only; the server keeps its hash."""
    token, secret = token_service.create(session, name=body.name, scopes=body.scopes, expires_in_s=body.expires_in_s,
                                         hosts=body.hosts)
    return TokenCreated(**TokenPublic.model_validate(token).model_dump(), token=secret)


@router.get("/tokens", response_model=TokensPublic)
def list_tokens(session: SessionDep, _: AdminToken) -> TokensPublic:
    return TokensPublic(data=[TokenPublic.model_validate(token) for token in token_service.list_all(session)])


@router.delete("/tokens/{token_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               responses=errors(404))
def revoke_token(token_id: Annotated[int, Path(ge=1, le=MAX_INT32)], request: Request, session: SessionDep,
                 _: AdminToken) -> Response:
    token_service.revoke(session, token_id)
    request.app.state.token_cache.clear()  # effective at once in this process
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/whoami", response_model=TokenPublic)
def whoami(token: ReadToken) -> TokenPublic:
    """The calling token's name, scopes and expiry (the dashboard's login check)."""
    return TokenPublic.model_validate(token)
