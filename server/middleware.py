"""ASGI middleware of the API: request body size limit, security headers.

Pure ASGI (no BaseHTTPMiddleware), so streaming responses pass through untouched.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimitMiddleware:
    """Refuse bodies over `max_bytes` with a 413 in the API's error shape.

    A declared Content-Length over the limit is refused before the app runs; a chunked body is counted
    as it streams in, and the read that crosses the limit raises, which the app's handlers render.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _too_large(send, self.max_bytes)
                return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, f"request body larger than {self.max_bytes} bytes")
            return message

        await self.app(scope, counting_receive, send)


async def _too_large(send: Send, limit: int) -> None:
    body = (b'{"error":{"code":"PAYLOAD_TOO_LARGE","message":"request body larger than %d bytes","details":null}}'
            % limit)
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


# The dashboard serves its own scripts and styles only; `style-src 'unsafe-inline'` is for the width
# of the phase-split bars (style attributes), never for scripts. No page may be framed (clickjacking).
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
                           "form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


class SecurityHeadersMiddleware:
    """Add the browser-facing security headers to every response (API responses carry them too:
    harmless for JSON clients, and a JSON error rendered in a browser tab gets the same protection)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = list(message.get("headers", [])) + [
                    (name, value) for name, value in SECURITY_HEADERS if name not in present]
            await send(message)

        await self.app(scope, receive, with_headers)
