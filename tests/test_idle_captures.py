"""An idle engine's captures ahead of need: one per step until the list is done, then a single log line."""

from __future__ import annotations

import logging

from deltaserve.engine.idle_captures import CapturesAhead


def test_one_capture_per_step_then_done_logged_once(caplog) -> None:
    left, captured, asked = [3, 2, 1], [], []

    def next_key():
        asked.append(len(left))
        return left[0] if left else None

    def capture(key):
        captured.append(key)
        left.remove(key)

    ahead = CapturesAhead("decode graphs", next_key, capture, lambda: f"{len(captured)} captured")
    with caplog.at_level(logging.INFO, logger="deltaserve.engine.idle_captures"):
        steps = [ahead.step() for _ in range(5)]
    assert steps == [True, True, True, False, False] and captured == [3, 2, 1]
    assert ahead.done and asked == [3, 2, 1, 0]  # never asked again once done
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("decode graphs ahead of need: done, 3 captured, ") and message.endswith(
        " s of idle time"
    )
