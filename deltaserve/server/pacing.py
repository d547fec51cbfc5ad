"""Admission paced per event-loop iteration, so a burst of arrivals cannot stall the running streams.

A request's admission (body parsing, validation, tokenization, the send to the engine) is about a
millisecond of the event loop's time, with no await long enough to let anything else run. Requests
that arrive together all start in the same loop iteration: a closed-loop wave of 255 replacements holds
every running stream for ~255 of those milliseconds. `AdmissionPacer` lets at most `per_iteration`
requests start per loop iteration and queues the rest in arrival order, so the streams' writes run
between every few admissions. An idle loop turns in microseconds: a lone request does not wait.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send

ADMISSIONS_PER_LOOP_ITERATION = 8


class AdmissionPacer:
    def __init__(self, per_iteration: int = ADMISSIONS_PER_LOOP_ITERATION) -> None:
        if per_iteration < 1:
            raise ValueError(f"per_iteration must be at least 1, got {per_iteration}")
        self.per_iteration = per_iteration
        self._started = 0  # requests let through since the last turn of the loop
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._turn_scheduled = False

    async def turn(self) -> None:
        """Returns once this request may start its admission. Invariant: requests start in arrival
        order, at most `per_iteration` between two turns of the loop."""
        if not self._waiting and self._started < self.per_iteration:
            self._started += 1
            self._schedule_turn()
            return
        ticket = asyncio.get_running_loop().create_future()
        self._waiting.append(ticket)
        self._schedule_turn()
        try:
            await ticket
        except asyncio.CancelledError:
            if not ticket.done():
                self._waiting.remove(ticket)
            raise

    def _schedule_turn(self) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_scheduled = False
        self._started = 0
        while self._waiting and self._started < self.per_iteration:
            ticket = self._waiting.popleft()
            if not ticket.done():
                ticket.set_result(None)
                self._started += 1
        if self._waiting or self._started:
            self._schedule_turn()


class PacedAdmission:
    """ASGI middleware: every POST waits for its turn (`AdmissionPacer`) before the app reads it."""

    def __init__(self, app: ASGIApp, pacer: AdmissionPacer) -> None:
        self.app = app
        self.pacer = pacer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            await self.pacer.turn()
        await self.app(scope, receive, send)
