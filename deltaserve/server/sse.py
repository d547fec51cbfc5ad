"""Server-sent events as OpenAI clients parse them, and the streaming response that carries them.

Chat and completions streams are `data: {json}` events ending with `data: [DONE]`; Responses streams
are `event: TYPE` + `data: {json}` events without [DONE]. An error after the headers went out is an
event `{"error": {...}}` (then [DONE] where the format has it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def data_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def typed_event(event_type: str, payload: BaseModel) -> str:
    return f"event: {event_type}\ndata: {payload.model_dump_json()}\n\n"


class SSEResponse(StreamingResponse):
    """A stream that ends as soon as the client goes away, whatever the body is waiting for.

    Starlette listens for the disconnect only when the server reports ASGI spec < 2.4 (uvicorn 0.54
    reports 2.3); from 2.4 on it notices only when a write fails, which never happens while a request
    waits in the engine queue or its text is held back. This class always listens, and always closes
    the body iterator, which aborts the engine request.
    """

    media_type = "text/event-stream"

    def __init__(
        self, content: Any, status_code: int = 200, on_close: Callable[[], None] | None = None
    ) -> None:
        """`on_close` runs once the response is over, however it ended (the body may never have started)."""
        super().__init__(
            content,
            status_code=status_code,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()
