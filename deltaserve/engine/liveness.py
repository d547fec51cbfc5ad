"""When an engine counts as hung, from its heartbeats (engine/process.py sends one every
HEARTBEAT_INTERVAL_S, whatever its scheduler loop is doing).

- No message at all for `heartbeat_timeout_s`: the process is frozen (stopped, or stuck where no thread
  of it can run).
- A heartbeat saying the loop completed no tick for `step_timeout_s` while the client has requests in
  flight: the scheduler is stuck. (Only the client knows that reliably: while the loop is stuck its
  published load is as old as its last tick.) A long but working step (a large prefill on CPU) looks the same from outside for
  as long as it runs, so this limit must stay above the longest legitimate step; its default does.
An idle engine is never hung: its loop ticks every 50 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.engine.protocol import Heartbeat

DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0  # twenty missed heartbeats
DEFAULT_STEP_TIMEOUT_S = 600.0  # a prefill chunk of a 27B model on CPU takes minutes, not ten


@dataclass(frozen=True, slots=True)
class HangLimits:
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S


def hang_reason(silent_s: float, last: Heartbeat | None, pending: bool, limits: HangLimits) -> str | None:
    """Why an engine last heard from `silent_s` ago, whose latest heartbeat was `last`, is hung while
    requests are (`pending`) or are not in flight; None while it is not hung."""
    if silent_s > limits.heartbeat_timeout_s:
        return (
            f"the engine process sent no heartbeat for {silent_s:.1f} s (--engine-heartbeat-timeout-s "
            f"{limits.heartbeat_timeout_s:g}): it is frozen"
        )
    if pending and last is not None and last.stalled_s > limits.step_timeout_s:
        return (
            f"the engine loop completed no step for {last.stalled_s:.1f} s with requests pending "
            f"(--engine-step-timeout-s {limits.step_timeout_s:g}): it is stuck"
        )
    return None
