"""A request's time to first token inside the server, cut where the latency log saw it.

With DELTASERVE_ITL_DEBUG=1 the API server logs one ITL_REQ line per request at its first token and the
engine one ITL_STEP line per step, on the host's one monotonic clock. Together they cut the server's
part of TTFT (from the request's arrival in its handler to the first token detokenized in the API
server) in four: the handler's checks and tokenizing, the way to the engine and the wait for its first step with the request, the
engine's steps up to the end of the one that sampled the token, and the delivery (the engine's
emission, the transport and the detokenization). The client's TTFT adds what comes before the
handler (the body's upload, JSON parsing, the request model's validation), the response's write and
the network.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_LINE = re.compile(
    r"ITL_REQ mono_us=(\d+) arrival_us=(\d+) submitted_us=(\d+) queued_us=(-?\d+) prompt_tokens=(\d+)"
)
PROMPT_BINS = ((1, 256), (257, 2048), (2049, 8192), (8193, 32768), (32769, None))


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One ITL_REQ line, in µs on the monotonic clock."""

    token_us: int  # the first token detokenized in the API server
    arrival_us: int  # the request's arrival in its handler (its body parsed and validated)
    submitted_us: int  # parsed and tokenized, handed to the engine
    queued_us: int | None  # from submission to the engine's first step with it (None: not reported)
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class FirstTokenSplit:
    """One request's time to first token in the server, in ms: total = tokenize + queue + steps +
    delivery."""

    prompt_tokens: int
    total_ms: float
    tokenize_ms: float  # arrival to submission: the handler's checks, the chat template, tokenization
    queue_ms: float  # to the engine's first step with it: transport, and the wait for admission
    steps_ms: float  # to the end of the last step before the token: its chunks, and the step sampling it
    delivery_ms: float  # that step's end to the token in the API server: emission, transport, detokenizing
    last_step_device_ms: float | None = None  # that step's device time, where its line has it (CUDA)


@dataclass(frozen=True, slots=True)
class StepEnds:
    """The step lines' ends (µs, ascending) and each step's device time (µs; None where not timed)."""

    ends_us: list[int]
    device_us: list[int | None]

    @classmethod
    def of(cls, steps: Iterable[tuple[int, int | None]]) -> StepEnds:
        ordered = sorted(steps, key=lambda s: s[0])
        return cls([end for end, _ in ordered], [device for _, device in ordered])


def parse_first_tokens(lines: Iterable[str]) -> list[FirstToken]:
    out = []
    for line in lines:
        m = _LINE.search(line)
        if m:
            token, arrival, submitted, queued, prompt = (int(g) for g in m.groups())
            out.append(FirstToken(token, arrival, submitted, None if queued < 0 else queued, prompt))
    return out


def split_first_token(first: FirstToken, steps: StepEnds) -> FirstTokenSplit | None:
    """`first` cut at the end of the last step before its token; None where the engine did not report
    the queue time or no step ended between its first step and the token (the log began later)."""
    if first.queued_us is None:
        return None
    scheduled = first.submitted_us + first.queued_us
    i = bisect.bisect_right(steps.ends_us, first.token_us) - 1
    if i < 0 or steps.ends_us[i] < scheduled:
        return None
    end, device = steps.ends_us[i], steps.device_us[i]
    return FirstTokenSplit(
        first.prompt_tokens,
        (first.token_us - first.arrival_us) / 1000,
        (first.submitted_us - first.arrival_us) / 1000,
        first.queued_us / 1000,
        (end - scheduled) / 1000,
        (first.token_us - end) / 1000,
        None if device is None else device / 1000,
    )


@dataclass(frozen=True, slots=True)
class FirstTokenStats:
    """Medians of each part over a group of requests (they need not add up to the total's median)."""

    name: str
    count: int
    total_median_ms: float
    total_p99_ms: float
    tokenize_median_ms: float
    queue_median_ms: float
    steps_median_ms: float
    delivery_median_ms: float
    last_step_device_median_ms: float | None  # over the group's requests whose step was timed


def first_token_stats(splits: Sequence[FirstTokenSplit]) -> list[FirstTokenStats]:
    """Per PROMPT_BINS group of prompt lengths that has requests."""
    out = []
    for lo, hi in PROMPT_BINS:
        group = [s for s in splits if lo <= s.prompt_tokens and (hi is None or s.prompt_tokens <= hi)]
        if not group:
            continue

        def median(part: str, group: list[FirstTokenSplit] = group) -> float:
            return float(np.median([getattr(s, part) for s in group]))

        timed = [s.last_step_device_ms for s in group if s.last_step_device_ms is not None]

        out.append(
            FirstTokenStats(
                f"prompt {lo}-{hi if hi is not None else ''}",
                len(group),
                median("total_ms"),
                float(np.percentile([s.total_ms for s in group], 99)),
                median("tokenize_ms"),
                median("queue_ms"),
                median("steps_ms"),
                median("delivery_ms"),
                float(np.median(timed)) if timed else None,
            )
        )
    return out


def print_first_tokens(lines: Sequence[str], steps: StepEnds) -> None:
    """The report's section for the log's ITL_REQ lines (nothing when it has none)."""
    splits = [s for f in parse_first_tokens(lines) if (s := split_first_token(f, steps)) is not None]
    stats = first_token_stats(splits)
    if not stats:
        return
    print(
        "time to first token in the server, ms: total median and p99, then each part's median "
        "(device: the step that sampled it)"
    )
    print(
        f"  {'':20s} {'n':>6s} {'total':>8s} {'p99':>8s} {'tokenize':>9s} {'queue':>8s} {'steps':>8s}"
        f" {'device':>8s} {'delivery':>9s}"
    )
    for s in stats:
        device = "-" if s.last_step_device_median_ms is None else f"{s.last_step_device_median_ms:.2f}"
        print(
            f"  {s.name:20s} {s.count:6d} {s.total_median_ms:8.2f} {s.total_p99_ms:8.2f} "
            f"{s.tokenize_median_ms:9.2f} {s.queue_median_ms:8.2f} {s.steps_median_ms:8.2f} {device:>8s} "
            f"{s.delivery_median_ms:9.2f}"
        )
