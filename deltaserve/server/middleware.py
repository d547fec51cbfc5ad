"""ASGI middlewares that answer before any handler runs: API-key auth, the request body limit and the
body read timeout.

Both are plain ASGI (not BaseHTTPMiddleware) so the handler's `receive` channel stays the server's own:
disconnect detection (disconnect.py, sse.py) listens on it.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.server.errors import AUTHENTICATION, INVALID_REQUEST
from deltaserve.server.protocol import ErrorBody, ErrorResponse

# Every route that does work needs the key; these answer from memory and stay open (for probes).
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
METRICS_PATH = "/metrics"


async def send_error(send: Send, status: int, message: str, type: str, code: str | None = None) -> None:
    body = ErrorResponse(error=ErrorBody(message=message, type=type, code=code)).model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _route_path(scope: Scope) -> str:
    """The path the routes see: uvicorn puts --root-path in front of the request's path."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class APIKeyAuth:
    """401 without `Authorization: Bearer <key>` (compared in constant time) on every route but
    OPEN_PATHS, and /metrics unless `protect_metrics`. Checked before the body is read."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = OPEN_PATHS if protect_metrics else OPEN_PATHS | {METRICS_PATH}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and _route_path(scope) not in self._open
            and scope.get("method") != "OPTIONS"
        ):
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self._expected):
                reason = "missing" if not given else "wrong"
                await send_error(
                    send,
                    401,
                    f"{reason} API key: send 'Authorization: Bearer <key>'",
                    AUTHENTICATION,
                    "invalid_api_key",
                )
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """413 for a request body over `max_bytes`: at once from Content-Length, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self, size: str) -> str:
        return f"the request body ({size}) exceeds the limit of {self.max_bytes} bytes (--max-request-body-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(
                send, 413, self._message(f"{int(length)} bytes"), INVALID_REQUEST, "request_too_large"
            )
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises an HTTPException from body reading; app.py shapes it.
                    raise HTTPException(413, self._message(f"over {received} bytes"))
            return message

        await self.app(scope, limited, send)


class BodyReadTimeout:
    """408 for a request whose body is not in after `timeout_s` (a Content-Length larger than what is
    sent would otherwise hold the request open forever). Once the body is in, `receive` is the
    server's own again: disconnect listeners wait on it without a limit."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout_s
        body_done = False

        async def bounded() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.timeout_s:g} s (--body-read-timeout-s)",
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, bounded, send)
