"""SSEResponse ends a stream whose client left even when nothing is being written (ASGI spec 2.4)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deltaserve.server.sse import DONE, SSEResponse


def test_disconnect_while_the_body_waits_closes_the_body_iterator() -> None:
    closed = asyncio.Event()
    sent: list[dict] = []

    async def body() -> AsyncIterator[str]:
        try:
            yield "data: first\n\n"
            await asyncio.Event().wait()  # a request waiting in the engine queue: no writes
            yield DONE
        finally:
            closed.set()

    async def receive() -> dict:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}

    async def run() -> None:
        await asyncio.wait_for(SSEResponse(body())(scope, receive, send), timeout=5)

    asyncio.run(run())
    assert closed.is_set()
    assert sent[0]["type"] == "http.response.start" and sent[1]["body"] == b"data: first\n\n"


def test_complete_stream_is_sent_in_order_and_ended() -> None:
    sent: list[dict] = []

    async def body() -> AsyncIterator[str]:
        for event in ("data: 1\n\n", "data: 2\n\n", DONE):
            yield event

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(asyncio.wait_for(SSEResponse(body())({**scope}, receive, send), timeout=5))
    bodies = [m.get("body") for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: 1\n\n", b"data: 2\n\n", DONE.encode(), b""]
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
