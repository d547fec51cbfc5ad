"""Per-step ITL telemetry: DELTASERVE_ITL_DEBUG=1 logs one line per step.

Read once at import. When off, the hot path pays one module-level boolean check per step: no
formatting, no clock reads beyond the step's own.
"""

from __future__ import annotations

import time

from deltaserve.engine.scheduler.state import SchedulerConfig
from deltaserve.engine.step import DeviceSpan, PendingStep
from deltaserve.itl_debug import ITL_DEBUG as ITL_DEBUG  # the flag's one reading; callers check it here
from deltaserve.itl_debug import logger
from deltaserve.ops.alloc_counters import allocation_counts, counts_since

# Where the step's host time went: (phase, its end) in order, since the step started. Only the
# scheduler thread marks and logs, so one module-level list serves.
_marks: list[tuple[str, float]] = []
_allocations: dict[str, int] = {}  # allocation_counts() at the previous line
# The device span of the step this tick launched through the scheduler (a backend timing its steps):
# the line's step when the tick delivered no step launched ahead.
_launched: list[DeviceSpan] = []


def mark(phase: str) -> None:
    """Ends `phase` of the running step (callers check ITL_DEBUG first): plan (rows and pages), launch
    (the backend's host time: inputs, replay, sampling enqueued), wait (the device), apply (dispatch)."""
    _marks.append((phase, time.monotonic()))


def note_launch(step: PendingStep) -> None:
    """Notes a step launched this tick (callers check ITL_DEBUG first)."""
    _launched[:] = [] if step.device_span is None else [step.device_span]


def device_fields(span: DeviceSpan | None) -> str:
    """The line's device time and the stream's idle time before the step, in µs, once the step is done
    on the device (a step logged at its launch has none)."""
    if span is None or not span.done:
        return ""
    idle = span.idle_ms()
    return f" device_us={int(span.device_ms() * 1000)}" + (
        "" if idle is None else f" idle_us={int(idle * 1000)}"
    )


def log_itl_step(
    kind: str,
    prefill_tokens: int,
    prefill_reqs: int,
    decode_rows: int,
    started: float,
    ended: float,
    span: DeviceSpan | None = None,
) -> None:
    """One line for the tick's step; `span`: the device span of the step it delivered, else the one the
    tick launched (if any)."""
    if span is None and _launched:
        span = _launched[0]
    _launched.clear()
    phases, last = [], started
    for phase, at in _marks:
        phases.append(f"{phase}:{int((at - last) * 1e6)}")
        last = at
    _marks.clear()
    counts = allocation_counts()
    moved = counts_since(_allocations, counts) if _allocations else {}
    _allocations.update(counts)
    logger.info(
        "ITL_STEP mono_us=%d kind=%s prefill_tokens=%d prefill_reqs=%d decode_rows=%d step_us=%d phases_us=%s"
        "%s%s",
        int(ended * 1e6),
        kind,
        prefill_tokens,
        prefill_reqs,
        decode_rows,
        int((ended - started) * 1e6),
        ",".join(phases) or "-",
        (" allocs=" + ",".join(f"{k}:{v}" for k, v in moved.items())) if moved else "",
        device_fields(span),
    )


def log_start(config: SchedulerConfig) -> None:
    logger.debug(
        "scheduler started: policy=%s overlap=%s decode_ahead=%s max_num_seqs=%d max_num_batched_tokens=%d "
        "(saturated: %d)",
        config.policy,
        config.prefill_overlap,
        config.decode_ahead,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_num_batched_tokens_saturated,
    )
