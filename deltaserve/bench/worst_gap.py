"""Where a run's worst inter-token gap happened and how wide it was: for attribution of an ITL max.

A gap that every active stream saw at the same moment is a stall of a whole process (the client's, the
API server's or the engine's); a gap that one stream saw alone belongs to that request (its prefill, a
preemption). `streams_stalled` counts the other streams that were active across the whole gap and got
no chunk inside it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from deltaserve.bench.metrics import RequestRecord


@dataclass(frozen=True, slots=True)
class WorstGap:
    ms: float
    request: int  # index of the request in send order
    token: int  # the chunk that ended the gap (1: the second chunk of the stream)
    at_s: float  # the gap's end, seconds after the run's first send
    streams_stalled: int  # other streams active across the gap with no chunk inside it
    streams_active: int  # other streams active across the gap


def worst_gap(records: list[RequestRecord]) -> WorstGap | None:
    """The largest gap between two chunks of one successful stream; None without any."""
    ok = [(i, r) for i, r in enumerate(records) if r.success and len(r.chunk_times) > 1]
    if not ok:
        return None
    request, token, record = max(
        ((i, k, r) for i, r in ok for k in range(1, len(r.chunk_times))),
        key=lambda item: item[2].chunk_times[item[1]] - item[2].chunk_times[item[1] - 1],
    )
    start, end = record.chunk_times[token - 1], record.chunk_times[token]
    active = stalled = 0
    for i, other in ok:
        times = other.chunk_times
        if i == request or times[0] > start or times[-1] < end:
            continue
        active += 1
        inside = bisect.bisect_left(times, end) - bisect.bisect_right(times, start)
        stalled += inside == 0
    first_send = min(r.send_time for r in records)
    return WorstGap((end - start) * 1e3, request, token, end - first_send, stalled, active)


def worst_gap_line(gap: WorstGap | None) -> str:
    if gap is None:
        return "Worst ITL gap: none (no stream with two chunks)"
    return (
        f"Worst ITL gap: {gap.ms:.1f} ms, request {gap.request} before chunk {gap.token}, "
        f"{gap.at_s:.2f} s into the run; {gap.streams_stalled} of {gap.streams_active} other active "
        "streams got no chunk during it"
    )
