"""A consumer behind its engine gets each request's backlog as one update (engine/protocol.py's
coalesce_updates, used by engine/client.py's generate), and with a stream interval its tokens that many
at a time (releases_held)."""

from __future__ import annotations

import asyncio

import pytest

from deltaserve.engine.client import AsyncEngineClient, EngineDeadError, _EngineGone, releases_held
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


def _deliver(client: AsyncEngineClient, item: RequestUpdate | _EngineGone) -> None:
    """As the client's receiving task hands an engine update (or the engine's death) to request "r"."""
    stream = client._streams["r"]
    if isinstance(item, _EngineGone):
        stream.end(item.reason)
    else:
        stream.receive(item, client.stream_interval)


async def _first_update_after(client: AsyncEngineClient, queued: list[RequestUpdate | _EngineGone]):
    """Starts a request, queues `queued` while its reader waits, and returns the reader's iterator and
    what it read first."""
    updates = client.generate("r", [1, 2], SamplingParams(max_tokens=8))
    reading = asyncio.ensure_future(updates.__anext__())
    await asyncio.sleep(0)  # the request is sent and its reader waits on its queue
    # The reader is woken by the first item; everything queued before it runs is read in the same go.
    for item in queued:
        _deliver(client, item)
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


@pytest.mark.parametrize(
    ("held_tokens", "interval", "token_sent", "finished", "released"),
    [
        (0, 1, True, False, True),  # interval 1: every update at once, a token-less one too
        (1, 4, False, False, True),  # the first token at once
        (0, 4, False, False, True),  # and what comes before it
        (3, 4, True, False, False),  # then held until the interval is full
        (4, 4, True, False, True),
        (6, 4, True, False, True),  # a backlog past the interval leaves whole
        (1, 4, True, True, True),  # the terminal never waits
    ],
)
def test_releases_held_by_hand(
    held_tokens: int, interval: int, token_sent: bool, finished: bool, released: bool
) -> None:
    assert releases_held(held_tokens, interval, token_sent, finished) is released


def _read_one_by_one(interval: int, items: list[RequestUpdate | _EngineGone]) -> list[RequestUpdate | str]:
    """What a reader of a client with `interval` gets when the engine's updates arrive one at a time,
    each read before the next arrives; an engine death ends the list with its message."""

    async def run() -> list[RequestUpdate | str]:
        client = _client()
        client.stream_interval = interval
        updates = client.generate("r", [1, 2], SamplingParams(max_tokens=8))
        got: list[RequestUpdate | str] = []

        async def read() -> None:
            try:
                async for update in updates:
                    got.append(update)
            except EngineDeadError as exc:
                got.append(str(exc))

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        for item in items:
            _deliver(client, item)
            for _ in range(3):  # the reader runs up to its next wait
                await asyncio.sleep(0)
        await reader
        return got

    return asyncio.run(run())


def test_a_stream_interval_sends_the_first_token_at_once_then_that_many_and_the_rest_at_the_end() -> None:
    steps = [RequestUpdate("r", [10 + i], num_output_tokens=i + 1) for i in range(7)]
    steps.append(RequestUpdate("r", [17], finish_reason="length", num_output_tokens=8))
    got = _read_one_by_one(3, list(steps))
    assert [(u.new_token_ids, u.finish_reason) for u in got] == [  # type: ignore[union-attr]
        ([10], None),
        ([11, 12, 13], None),
        ([14, 15, 16], None),
        ([17], "length"),
    ]
    assert [u.num_output_tokens for u in got] == [1, 4, 7, 8]  # type: ignore[union-attr]
    one_by_one = _read_one_by_one(1, list(steps))
    assert [u.new_token_ids for u in one_by_one] == [[10 + i] for i in range(8)]  # type: ignore[union-attr]


def test_tokens_held_for_the_interval_are_delivered_before_the_engine_death_is_raised() -> None:
    items: list[RequestUpdate | _EngineGone] = [
        RequestUpdate("r", [3], num_output_tokens=1),
        RequestUpdate("r", [4], num_output_tokens=2),
        RequestUpdate("r", [5], num_output_tokens=3),
        _EngineGone("engine died"),
    ]
    got = _read_one_by_one(4, items)
    assert [u if isinstance(u, str) else u.new_token_ids for u in got] == [[3], [4, 5], "engine died"]
