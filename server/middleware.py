"""ASGI middleware of the API: request body size limit.

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
