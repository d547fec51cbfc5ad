"""Graph captures an idle engine makes ahead of need, one per idle tick (decode and prefill graphs)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K")


class CapturesAhead(Generic[K]):
    """`step()` captures `next_key()` (None: nothing left) and returns True, or returns False once the
    list is done, logging the first time how long the captures took: `what` and `summary()` name them."""

    def __init__(
        self,
        what: str,
        next_key: Callable[[], K | None],
        capture: Callable[[K], object],
        summary: Callable[[], str],
    ) -> None:
        self.what = what
        self._next_key = next_key
        self._capture = capture
        self._summary = summary
        self._seconds = 0.0
        self.done = False

    def step(self) -> bool:
        """For idle time only: it blocks for one capture."""
        if self.done:
            return False
        key = self._next_key()
        if key is None:
            self.done = True
            logger.info(
                "%s ahead of need: done, %s, %.1f s of idle time", self.what, self._summary(), self._seconds
            )
            return False
        started = time.monotonic()
        self._capture(key)
        self._seconds += time.monotonic() - started
        return True
