"""`deltaserve bench steps LOG...`: what the steps of a server run cost, from its per-step log lines.

A server started with DELTASERVE_ITL_DEBUG=1 logs one ITL_STEP line per scheduler step (its kind,
prefill tokens and requests, decode rows, end time and duration, and the duration's phases: planning,
the backend's host time, waiting for the device, applying the result). A decoding request's inter-token
latency is the interval between the ends of consecutive steps, so this groups those intervals, for the
steps that carry decode rows, by step kind and by prefill size: where an ITL percentile comes from.
Intervals of IDLE_GAP_MS or more are gaps between runs, not steps, and are left out.

Where the server timed its steps on the device (CUDA), a line also carries the step's device time and how
long the stream sat idle before it: per run, the device's busy and idle seconds say whether the host
kept the GPU fed. The idle time before a run's first step is the wait for the run's requests, not the
host's, and is left out. The API server's first-token lines (ITL_REQ) are cut at those steps:
deltaserve/bench/first_token_log.py.

It also splits each run's time (runs are separated by RUN_GAP_MS without a step) three ways: steps with
prompt tokens, decode-only steps while prompts were still to come (admission waiting for KV pages or
slots), and the decode-only tail after the run's last prompt token: a saturated cell's throughput is the
first kind's rate, diluted by the other two.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaserve.bench.first_token_log import StepEnds, print_first_tokens

IDLE_GAP_MS = 2000.0
# Half a second without a step that feeds tokens ends a run (a warm-up and the measured run after it): under
# load the engine steps back to back, a first-use graph capture (~0.1-0.3 s) happening inside a step.
RUN_GAP_MS = 500.0
PREFILL_BINS = ((0, 0), (1, 256), (257, 1024), (1025, 2048), (2049, 4096), (4097, None))

_LINE = re.compile(
    r"ITL_STEP mono_us=(\d+) kind=(\S+) prefill_tokens=(\d+) prefill_reqs=(\d+) decode_rows=(\d+) step_us=(\d+)"
    r"(?: phases_us=(\S+))?(?: allocs=(\S+))?(?: device_us=(\d+))?(?: idle_us=(-?\d+))?"
)
PHASES = ("plan", "launch", "wait", "apply")  # the step's host time, in order (engine/scheduler/telemetry.py)


@dataclass(frozen=True, slots=True)
class StepRecord:
    end_us: int
    kind: str
    prefill_tokens: int
    prefill_reqs: int
    decode_rows: int
    step_us: int
    phases_us: tuple[tuple[str, int], ...] = ()  # (phase, µs) in order; a phase may repeat
    # Allocations since the previous line that can synchronise the device (ops/alloc_counters.py).
    allocs: str = ""
    device_us: int | None = None  # the step's time on the device, first kernel to results copied
    idle_us: int | None = None  # the stream's idle time between the launch before it and this step

    @property
    def launched_only(self) -> bool:
        """A tick that launched this step ahead and delivered none: the step has a second line, from
        the tick that delivers it (the one with the wait for the device)."""
        phases = {name for name, _ in self.phases_us}
        return self.kind.endswith("_ahead") and bool(phases) and "wait" not in phases


@dataclass(frozen=True, slots=True)
class Interval:
    """The time from the previous step's end to this step's end."""

    ms: float
    step: StepRecord


@dataclass(frozen=True, slots=True)
class GroupStats:
    name: str
    count: int
    median_ms: float
    p99_ms: float
    max_ms: float
    step_median_ms: float
    phase_median_ms: dict[str, float]  # per PHASES entry: the median over the group's steps (0 where absent)


def parse_steps(lines: Iterable[str]) -> list[StepRecord]:
    records = []
    for line in lines:
        m = _LINE.search(line)
        if m:
            end, kind, tokens, reqs, rows, step, phases, allocs, device, idle = m.groups()
            records.append(
                StepRecord(
                    int(end),
                    kind,
                    int(tokens),
                    int(reqs),
                    int(rows),
                    int(step),
                    _parse_phases(phases),
                    allocs or "",
                    None if device is None else int(device),
                    None if idle is None else int(idle),
                )
            )
    return records


def _parse_phases(text: str | None) -> tuple[tuple[str, int], ...]:
    if not text or text == "-":
        return ()
    pairs = (item.partition(":") for item in text.split(","))
    return tuple((name, int(us)) for name, _, us in pairs)


def phase_ms(step: StepRecord, phase: str) -> float:
    """The step's time in `phase` (summed where it repeats), in ms."""
    return sum(us for name, us in step.phases_us if name == phase) / 1000


def intervals(records: Sequence[StepRecord]) -> list[Interval]:
    """Each step's interval from the previous step's end, for steps with decode rows (idle gaps out)."""
    out = []
    for prev, cur in zip(records, records[1:], strict=False):
        ms = (cur.end_us - prev.end_us) / 1000
        if cur.decode_rows > 0 and ms < IDLE_GAP_MS:
            out.append(Interval(ms, cur))
    return out


def group_stats(name: str, group: Sequence[Interval]) -> GroupStats | None:
    if not group:
        return None
    ms = np.array([i.ms for i in group])
    return GroupStats(
        name,
        len(ms),
        float(np.percentile(ms, 50)),
        float(np.percentile(ms, 99)),  # as `bench serve` computes ITL p99
        float(ms.max()),
        float(np.median([i.step.step_us / 1000 for i in group])),
        {p: float(np.median([phase_ms(i.step, p) for i in group])) for p in PHASES},
    )


def summarize(records: Sequence[StepRecord]) -> list[GroupStats]:
    """All intervals, then by step kind, then by the step's prefill tokens (PREFILL_BINS)."""
    found = intervals(records)
    groups: list[tuple[str, Callable[[Interval], bool]]] = [("steps with decode rows", lambda i: True)]
    for kind in sorted({i.step.kind for i in found}):
        groups.append((f"kind {kind}", lambda i, k=kind: i.step.kind == k))
    for lo, hi in PREFILL_BINS:
        label = f"prefill {lo}" if lo == hi else f"prefill {lo}-{hi if hi is not None else ''}"
        groups.append(
            (
                label,
                lambda i, lo=lo, hi=hi: (
                    lo <= i.step.prefill_tokens and (hi is None or i.step.prefill_tokens <= hi)
                ),
            )
        )
    stats = (group_stats(name, [i for i in found if keep(i)]) for name, keep in groups)
    return [s for s in stats if s is not None]


@dataclass(frozen=True, slots=True)
class TimeShare:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0  # prompt tokens and decode rows fed

    def add(self, seconds: float, tokens: int, steps: int = 1) -> TimeShare:
        return TimeShare(self.steps + steps, self.seconds + seconds, self.tokens + tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class RunSplit:
    """One run's step time (each step's interval from the previous step's end; the run's first step:
    its own duration), split three ways."""

    with_prompts: TimeShare
    decode_only_prompts_to_come: TimeShare
    decode_only_tail: TimeShare

    @property
    def seconds(self) -> float:
        return sum(
            s.seconds for s in (self.with_prompts, self.decode_only_prompts_to_come, self.decode_only_tail)
        )


def runs(records: Sequence[StepRecord]) -> list[list[StepRecord]]:
    """The steps that feed tokens, in runs separated by RUN_GAP_MS or more from a step's end to the next
    one's start (a long step does not end a run)."""
    out: list[list[StepRecord]] = []
    prev_end: int | None = None
    for r in records:
        if r.prefill_tokens + r.decode_rows == 0:
            continue
        if prev_end is None or (r.end_us - r.step_us - prev_end) / 1000 >= RUN_GAP_MS:
            out.append([])
        out[-1].append(r)
        prev_end = r.end_us
    return out


def split_run(run: Sequence[StepRecord]) -> RunSplit:
    last_prompt = max((i for i, r in enumerate(run) if r.prefill_tokens > 0), default=-1)
    shares = [TimeShare(), TimeShare(), TimeShare()]
    for i, r in enumerate(run):
        seconds = (r.end_us - run[i - 1].end_us if i else r.step_us) / 1e6
        which = 0 if r.prefill_tokens > 0 else (1 if i < last_prompt else 2)
        if r.launched_only:  # its time here; its step and tokens with the line that delivers it
            shares[which] = shares[which].add(seconds, 0, steps=0)
        else:
            shares[which] = shares[which].add(seconds, r.prefill_tokens + r.decode_rows)
    return RunSplit(*shares)


@dataclass(frozen=True, slots=True)
class DeviceTime:
    """A run's steps whose lines carry their device time: the device's busy seconds over them and the
    stream's idle time before each but the run's first (per step, ms)."""

    steps: int
    device_s: float
    idle_s: float
    idle_median_ms: float
    idle_p99_ms: float
    idle_max_ms: float


def device_time(run: Sequence[StepRecord]) -> DeviceTime | None:
    timed = [r for r in run if r.device_us is not None]
    if not timed:
        return None
    # The run's first launch follows RUN_GAP_MS without a step: its idle time is the wait for requests. Its
    # span is the first to come back (one stream), though a line logged at its launch may come before.
    idle = np.array([r.idle_us / 1000 for r in timed[1:] if r.idle_us is not None] or [0.0])
    return DeviceTime(
        len(timed),
        sum(r.device_us for r in timed) / 1e6,
        float(idle.sum()) / 1000,
        float(np.percentile(idle, 50)),
        float(np.percentile(idle, 99)),
        float(idle.max()),
    )


def add_bench_steps_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", help="server logs written with DELTASERVE_ITL_DEBUG=1")
    parser.add_argument("--slowest", type=int, default=10, help="also list this many slowest intervals")


def run_bench_steps(args: argparse.Namespace) -> list[GroupStats]:
    lines: list[str] = []
    for path in args.logs:
        lines += Path(path).read_text(errors="replace").splitlines()
    records = parse_steps(lines)
    if not records:
        raise SystemExit(
            f"no ITL_STEP lines in {', '.join(args.logs)} (start the server with DELTASERVE_ITL_DEBUG=1)"
        )
    return _report(records, args.slowest, lines)


def write_report(server_log: Path, out: Path, slowest: int = 10) -> bool:
    """Writes what `bench steps server_log` prints to `out` when the log has step lines (a server run
    with DELTASERVE_ITL_DEBUG=1); False, writing nothing, when it has none."""
    lines = server_log.read_text(errors="replace").splitlines() if server_log.exists() else []
    records = parse_steps(lines)
    if not records:
        return False
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        _report(records, slowest, lines)
    out.write_text(text.getvalue())
    return True


def _report(records: Sequence[StepRecord], slowest_count: int, lines: Sequence[str] = ()) -> list[GroupStats]:
    stats = summarize(records)
    phase_heads = " ".join(f"{p:>7s}" for p in PHASES)
    print(
        f"{'interval to the step end, ms':28s} {'n':>6s} {'median':>8s} {'p99':>8s} {'max':>8s} {'step median':>12s}"
        f"  medians: {phase_heads}"
    )
    for s in stats:
        phases = " ".join(f"{s.phase_median_ms[p]:7.2f}" for p in PHASES)
        print(
            f"{s.name:28s} {s.count:6d} {s.median_ms:8.2f} {s.p99_ms:8.2f} {s.max_ms:8.2f} {s.step_median_ms:12.2f}"
            f"           {phases}"
        )
    _print_time_split(records)
    _print_device_time(records)
    print_first_tokens(lines, StepEnds.of((r.end_us, r.device_us) for r in records))
    slowest = sorted(intervals(records), key=lambda i: -i.ms)[:slowest_count]
    if slowest:
        print(
            "slowest intervals: ms, kind, prefill tokens / requests, decode rows, step ms, launch ms, allocations"
        )
        for i in slowest:
            st = i.step
            print(
                f"  {i.ms:8.2f}  {st.kind:12s} {st.prefill_tokens:6d} / {st.prefill_reqs:<3d} {st.decode_rows:5d}  "
                f"{st.step_us / 1000:8.2f}  {phase_ms(st, 'launch'):8.2f}  {st.allocs}"
            )
    return stats


def _print_time_split(records: Sequence[StepRecord]) -> None:
    splits = [split_run(run) for run in runs(records)]
    if not splits:
        return
    print("time per run: steps, seconds, tokens fed per second")
    print(
        f"  {'run':>3s} {'seconds':>8s}  {'with prompt tokens':>26s}  {'decode only, prompts to come':>28s}"
        f"  {'decode-only tail':>26s}"
    )
    for n, split in enumerate(splits, 1):
        cells = "  ".join(
            f"{s.steps:6d} {s.seconds:7.2f} s {s.tokens_per_s:9.0f}/s"
            for s in (split.with_prompts, split.decode_only_prompts_to_come, split.decode_only_tail)
        )
        print(f"  {n:3d} {split.seconds:8.2f}  {cells}")


def _print_device_time(records: Sequence[StepRecord]) -> None:
    rows = [(n, split_run(run), device_time(run)) for n, run in enumerate(runs(records), 1)]
    rows = [(n, split, dt) for n, split, dt in rows if dt is not None]
    if not rows:
        return
    print("device time per run: steps timed, busy seconds, idle seconds before them; idle per step, ms")
    print(
        f"  {'run':>3s} {'seconds':>8s} {'timed':>6s} {'busy s':>8s} {'idle s':>7s} {'median':>7s} {'p99':>7s}"
        f" {'max':>7s}"
    )
    for n, split, dt in rows:
        print(
            f"  {n:3d} {split.seconds:8.2f} {dt.steps:6d} {dt.device_s:8.2f} {dt.idle_s:7.2f} "
            f"{dt.idle_median_ms:7.2f} {dt.idle_p99_ms:7.2f} {dt.idle_max_ms:7.2f}"
        )
