"""A consumer behind its engine gets each request's backlog as one update (engine/protocol.py's
coalesce_updates, used by engine/client.py's generate)."""

from __future__ import annotations

import asyncio

import pytest

from deltaserve.engine.client import AsyncEngineClient, EngineDeadError, _EngineGone
from deltaserve.engine.core import EngineInfo
from deltaserve.engine.liveness import HangLimits
from deltaserve.engine.protocol import RequestUpdate, TokenLogprobs, coalesce_updates
from deltaserve.sampling_params import SamplingParams


def _lp(x: float) -> TokenLogprobs:
    return TokenLogprobs(logprob=x, rank=1, top=[])


def test_updates_join_tokens_and_logprobs_in_order_and_take_the_end_from_the_last() -> None:
    first = RequestUpdate(
        "r",
        [5],
        [_lp(-0.5)],
        num_prompt_tokens=7,
        num_output_tokens=1,
        queued_time=0.25,
        prompt_logprobs=[None, _lp(-1.0)],
        num_cached_tokens=4,
    )
    middle = RequestUpdate("r", [6, 7], [_lp(-0.6), _lp(-0.7)], num_prompt_tokens=7, num_output_tokens=3)
    last = RequestUpdate(
        "r", [8], [_lp(-0.8)], finish_reason="stop", stop_reason=8, num_output_tokens=4, num_cached_tokens=4
    )
    merged = coalesce_updates([first, middle, last])
    assert merged.new_token_ids == [5, 6, 7, 8]
    assert [lp.logprob for lp in merged.new_logprobs or []] == [-0.5, -0.6, -0.7, -0.8]
    assert (merged.finish_reason, merged.stop_reason) == ("stop", 8)
    assert merged.num_output_tokens == 4
    assert merged.num_prompt_tokens == 7  # the last that carries it
    assert merged.num_cached_tokens == 4
    assert merged.queued_time == 0.25  # once, from the first token
    assert merged.prompt_logprobs == [None, _lp(-1.0)]


def test_updates_without_logprobs_stay_without_and_one_update_is_itself() -> None:
    a, b = RequestUpdate("r", [1], num_output_tokens=1), RequestUpdate("r", [2], num_output_tokens=2)
    merged = coalesce_updates([a, b])
    assert merged.new_logprobs is None and merged.new_token_ids == [1, 2] and merged.finish_reason is None
    assert coalesce_updates([a]) is a


class _Push:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.sent.append(data)


def _client() -> AsyncEngineClient:
    info = EngineInfo("m", 64, 100, (), 8, 16, 128, 4, "cpu", "float32")
    return AsyncEngineClient(info, None, None, _Push(), None, "", HangLimits())  # type: ignore[arg-type]


async def _first_update_after(client: AsyncEngineClient, queued: list[RequestUpdate | _EngineGone]):
    """Starts a request, queues `queued` while its reader waits, and returns the reader's iterator and
    what it read first."""
    updates = client.generate("r", [1, 2], SamplingParams(max_tokens=8))
    reading = asyncio.ensure_future(updates.__anext__())
    await asyncio.sleep(0)  # the request is sent and its reader waits on its queue
    # The reader is woken by the first item; everything queued before it runs is read in the same go.
    for item in queued:
        client._queues["r"].put_nowait(item)
    return updates, await reading


def test_a_reader_behind_the_engine_gets_its_backlog_as_one_update_and_stops_at_the_terminal() -> None:
    async def run() -> list[RequestUpdate]:
        client = _client()
        backlog = [
            RequestUpdate("r", [3], num_output_tokens=1),
            RequestUpdate("r", [4], num_output_tokens=2),
            RequestUpdate("r", [5], finish_reason="length", num_output_tokens=3),
        ]
        updates, first = await _first_update_after(client, backlog)
        rest = [u async for u in updates]
        return [first, *rest]

    got = asyncio.run(run())
    assert [(u.new_token_ids, u.finish_reason) for u in got] == [([3, 4, 5], "length")]


def test_tokens_read_before_the_engine_died_are_delivered_then_the_death_is_raised() -> None:
    async def run() -> tuple[RequestUpdate, BaseException]:
        client = _client()
        queued = [RequestUpdate("r", [3]), RequestUpdate("r", [4]), _EngineGone("engine died")]
        updates, first = await _first_update_after(client, queued)
        with pytest.raises(EngineDeadError) as dead:
            await updates.__anext__()
        return first, dead.value

    first, dead = asyncio.run(run())
    assert first.new_token_ids == [3, 4] and not first.finished
    assert str(dead) == "engine died"
