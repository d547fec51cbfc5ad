"""server/pacing.py: a burst of arrivals starts a few requests per event-loop iteration, in arrival order,
with the loop free for other work between them."""

from __future__ import annotations

import asyncio

import pytest

from deltaserve.server.pacing import AdmissionPacer


class _LoopTurns:
    """Counts the event loop's iterations: one call_soon callback per iteration, rescheduling itself."""

    def __init__(self) -> None:
        self.count = 0
        self._running = True

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False

    def _tick(self) -> None:
        if self._running:
            self.count += 1
            asyncio.get_running_loop().call_soon(self._tick)


def test_a_burst_starts_per_iteration_in_arrival_order_and_the_loop_runs_between() -> None:
    async def run() -> list[tuple[int, int]]:
        pacer, turns = AdmissionPacer(per_iteration=2), _LoopTurns()
        started: list[tuple[int, int]] = []

        async def request(i: int) -> None:
            await pacer.turn()
            started.append((i, turns.count))

        turns.start()
        await asyncio.gather(*(request(i) for i in range(7)))
        turns.stop()
        return started

    started = asyncio.run(run())
    assert [i for i, _ in started] == list(range(7))  # arrival order
    per_iteration: dict[int, int] = {}
    for _, iteration in started:
        per_iteration[iteration] = per_iteration.get(iteration, 0) + 1
    assert max(per_iteration.values()) <= 2
    assert len(per_iteration) >= 4  # 7 requests, 2 a turn: the loop turned between them


def test_a_lone_request_passes_at_once() -> None:
    async def run() -> bool:
        pacer = AdmissionPacer(per_iteration=1)
        waiting = asyncio.ensure_future(pacer.turn())
        await asyncio.sleep(0)
        return waiting.done()

    assert asyncio.run(run())


def test_a_request_cancelled_while_waiting_leaves_the_queue_and_the_rest_still_start() -> None:
    async def run() -> list[int]:
        pacer = AdmissionPacer(per_iteration=1)
        started: list[int] = []

        async def request(i: int) -> None:
            await pacer.turn()
            started.append(i)

        tasks = [asyncio.ensure_future(request(i)) for i in range(4)]
        await asyncio.sleep(0)  # request 0 passes; 1, 2, 3 wait
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return started

    assert asyncio.run(run()) == [0, 1, 3]


def test_at_least_one_request_per_iteration() -> None:
    with pytest.raises(ValueError, match="per_iteration must be at least 1, got 0"):
        AdmissionPacer(per_iteration=0)
