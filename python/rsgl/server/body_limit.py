"""A request-body size limit enforced while the body is read (ASGI middleware).

A body announced larger than the limit is refused from its Content-Length before any of it
is read; a body that grows past the limit (chunked, or a lying Content-Length) is refused as
soon as it does. Either way the client gets a 413 OpenAI error object, and the app never
sees the request.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    """Buffers each HTTP request body up to `max_bytes`, then hands it to `app`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send, size)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            # The whole body once, then the client's later messages (a disconnect).
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, size: int) -> None:
        error: dict[str, Any] = {
            "error": {
                "message": (
                    f"the request body has {size} bytes or more; this server accepts at most "
                    f"{self.max_bytes} (--max-request-bytes)"
                ),
                "type": "RequestTooLargeError",
                "param": None,
                "code": 413,
            }
        }
        payload = json.dumps(error).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
