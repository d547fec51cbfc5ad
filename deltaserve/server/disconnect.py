"""Non-streaming requests end when their client goes away (streams: see sse.SSEResponse).

The handler's work runs as a task beside a listener on the ASGI `receive` channel; a disconnect cancels
the work, which closes the engine request's iterator and so aborts it in the engine within one step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready; nothing can be sent."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
