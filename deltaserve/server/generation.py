"""One engine request as the endpoints see it: token ids in, detokenized OutputDeltas out.

`generate()` owns the request's whole life in the API server: detokenization and stop strings
(OutputState), metrics, and the engine request itself. Invariants: it yields exactly one finished
delta, last; leaving it early (client gone, stop string matched, cancellation) aborts the engine
request, because closing the engine client's iterator sends the abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from deltaserve.engine.client import EngineDeadError
from deltaserve.engine.output import OutputDelta, OutputState
from deltaserve.sampling_params import SamplingParams
from deltaserve.server.admission import Reservation
from deltaserve.server.errors import SERVER_ERROR, APIError, engine_unavailable
from deltaserve.server.state import ServerState

T = TypeVar("T")
logger = logging.getLogger("deltaserve.server")


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    queue_place: Reservation | None = None  # held (shared with its siblings) until the request starts
    cache_points: list[int] = field(default_factory=list)  # chat message boundaries (prefix cache)
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes


async def generate(state: ServerState, req: EngineRequest, arrival: float) -> AsyncIterator[OutputDelta]:
    output = OutputState(req.request_id, req.prompt, req.prompt_token_ids, req.params, state.tokenizer)
    tracker = state.metrics.track(arrival)
    ended_by = "abort"  # what the metrics count if no terminal arrives: the client went away
    log = state.config.log_requests
    if log:
        logger.info("request %s: %d prompt tokens, %s", req.request_id, len(req.prompt_token_ids), req.params)
    queued = req.queue_place is not None
    state.inflight += 1
    try:
        updates = state.client.generate(
            req.request_id, req.prompt_token_ids, req.params, req.cache_points, req.cache_salt
        )
        async with contextlib.aclosing(updates):
            async for update in updates:
                if queued and req.queue_place is not None:
                    queued = False
                    req.queue_place.release()
                delta = output.apply(update)
                tracker.on_tokens(len(delta.token_ids), delta.num_prompt_tokens, update.queued_time)
                if delta.finished:
                    ended_by = delta.finish_reason or "error"
                    tracker.finish(ended_by)
                yield delta
                if delta.finished:
                    return  # a stop string may end it before the engine does: closing aborts it there
    except EngineDeadError as exc:
        ended_by = "error"
        raise engine_unavailable(str(exc)) from exc
    finally:
        if queued and req.queue_place is not None:
            req.queue_place.release()
        tracker.finish(ended_by)  # a no-op after the terminal
        state.inflight -= 1
        if log:
            logger.info(
                "request %s finished: %s, %d output tokens", req.request_id, ended_by, len(output.token_ids)
            )


def terminal_error(delta: OutputDelta) -> APIError | None:
    """The HTTP error of a terminal that is not a normal finish (stop, length)."""
    if delta.finish_reason == "rejected":
        param = "response_format" if delta.error_field == "structured_output" else delta.error_field
        return APIError(400, delta.error or "the engine rejected the request", param=param)
    if delta.finish_reason in ("error", "abort"):
        message = delta.error or "the engine ended the request"
        return APIError(500, message, type=SERVER_ERROR, code=500)
    return None


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several iterators as they arrive, tagged with the iterator's index. Closing the merged
    iterator (or an error in one stream) closes every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None, bool]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None, False))
        except Exception as exc:
            queue.put_nowait((index, None, exc, True))
            return
        queue.put_nowait((index, None, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                remaining -= 1
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
