"""How much engine work one request, and all waiting requests together, may hold.

- Fan-out: one HTTP request becomes prompts x n engine requests; past --max-choices-per-request it is
  a 400 naming the limit, so no single request can queue thousands of engine requests ahead of others.
- Queue: engine requests this server sent that have not started (no output yet: waiting for a slot or
  in their first prefill) are `queued`; a request that would take it past --max-queued-requests is
  shed with 503 + Retry-After, counted in `deltaserve:requests_shed_total`. /load reports `queued`.

Invariant: every reserved engine request is released exactly once: when it starts, ends, or when its
response ends without it ever starting (the client left first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.server.errors import UNAVAILABLE, APIError, bad_request

RETRY_AFTER_S = 1
MAX_CHOICES_FLAG = "--max-choices-per-request"
MAX_QUEUED_FLAG = "--max-queued-requests"


@dataclass(slots=True)
class Reservation:
    """Queue places held by one HTTP request's engine requests until each starts."""

    admission: Admission
    remaining: int

    def release(self, count: int = 1) -> None:
        count = min(count, self.remaining)
        self.remaining -= count
        self.admission.queued -= count

    def release_all(self) -> None:
        self.release(self.remaining)


class Admission:
    def __init__(self, max_choices: int, max_queued: int, on_shed: Callable[[], None]) -> None:
        self.max_choices = max_choices
        self.max_queued = max_queued
        self.queued = 0
        self._on_shed = on_shed

    def check_fanout(self, num_prompts: int, n: int) -> None:
        choices = num_prompts * n
        if choices > self.max_choices:
            shape = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
            raise bad_request(
                f"this request asks for {choices} choices ({shape}); at most {self.max_choices} per "
                f"request ({MAX_CHOICES_FLAG}): send fewer prompts or a smaller n",
                "n" if num_prompts == 1 else "prompt",
                code="too_many_choices",
            )

    def reserve(self, count: int) -> Reservation:
        """Places for `count` engine requests, or a 503 to retry later when the queue is full."""
        if self.queued + count > self.max_queued:
            self._on_shed()
            raise APIError(
                503,
                f"the server is overloaded: {self.queued} requests are queued, at most {self.max_queued} "
                f"({MAX_QUEUED_FLAG}); retry after {RETRY_AFTER_S} s",
                type=UNAVAILABLE,
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.queued += count
        return Reservation(self, count)
