"""`deltaserve bench latency`: in-process timing through the real EngineCore and scheduler (no HTTP).

Each iteration submits `--batch-size` requests of `--input-len` random token ids at once, with
`--output-len` tokens each (ignore_eos, greedy), and records when every update leaves the scheduler.
Reported per iteration (then the median): TTFT (submit -> first token), TPOT per request
((last - first) / (tokens - 1)), step ITL percentiles, and output tok/s. These are engine-side numbers
("in-process timer"), not serving claims: those come from `deltaserve bench serve` over HTTP.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from deltaserve.engine.protocol import AddRequest, StepOutputs
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
CAPTURES_AHEAD_TIMEOUT_S = 300.0  # ~9 s at the 4B shape

if TYPE_CHECKING:  # the engine (torch) is imported when the benchmark runs, not when the CLI parses
    from deltaserve.engine.core import EngineCore


@dataclass(slots=True)
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    ttft_ms: float  # median over requests
    tpot_ms: float  # median over requests
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    output_tok_s: float
    duration_s: float


def run_iteration(
    engine: EngineCore, collector: Collector, batch_size: int, input_len: int, output_len: int, seed: int
) -> LatencyResult:
    """`engine` is a started EngineCore publishing into `collector`."""
    rng = random.Random(seed)
    vocab = min(engine.info.vocab_size, 248044)
    collector.reset(batch_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.monotonic()
    for i in range(batch_size):
        prompt = [rng.randrange(vocab) for _ in range(input_len)]
        engine.submit(AddRequest(f"lat-{seed}-{i}", prompt, params, arrival_time=started))
    if not collector.done.wait(timeout=3600):
        raise TimeoutError("requests did not finish within an hour")
    ended = time.monotonic()
    ttft, tpot, itl = [], [], []
    for times in collector.times.values():
        ttft.append((times[0] - started) * 1e3)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
            itl += [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
    total_out = sum(len(t) for t in collector.times.values())
    itl_arr = np.array(itl or [0.0])
    return LatencyResult(
        batch_size=batch_size,
        input_len=input_len,
        output_len=output_len,
        ttft_ms=statistics.median(ttft),
        tpot_ms=statistics.median(tpot) if tpot else 0.0,
        itl_p50_ms=float(np.percentile(itl_arr, 50)),
        itl_p99_ms=float(np.percentile(itl_arr, 99)),
        itl_max_ms=float(itl_arr.max()),
        output_tok_s=total_out / (ended - started),
        duration_s=ended - started,
    )


class Collector:
    """Timestamps every token as it leaves the scheduler."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.done = threading.Event()
        self._left = 0
        self.errors: list[str] = []

    def reset(self, n: int) -> None:
        self.times = {}
        self._left = n
        self.done.clear()

    def __call__(self, out: StepOutputs) -> None:
        now = time.monotonic()
        for u in out.updates:
            self.times.setdefault(u.request_id, []).extend([now] * len(u.new_token_ids))
            if u.finished:
                if u.error:
                    self.errors.append(u.error)
                self._left -= 1
                if self._left == 0:
                    self.done.set()


def add_bench_latency_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--output-json", default=None, help="write all results here")
    parser.add_argument(
        "--cell",
        action="append",
        default=None,
        metavar="IN:OUT:BATCH",
        help="measure this cell (repeatable; replaces --input-len/--output-len/--batch-size): one engine "
        "start for a whole matrix, e.g. --cell 1:256:1 --cell 8192:1:1 --cell 1024:256:16",
    )


def parse_cell(text: str) -> tuple[int, int, int]:
    """'IN:OUT:BATCH' -> (input_len, output_len, batch_size), each a positive integer."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--cell expects IN:OUT:BATCH with three positive integers, got {text!r}")
    input_len, output_len, batch_size = map(int, parts)
    return input_len, output_len, batch_size


def bench_cells(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    if args.cell:
        return [parse_cell(c) for c in args.cell]
    return [(args.input_len, args.output_len, bs) for bs in args.batch_size]


def run_bench_latency(args: argparse.Namespace, engine_config: EngineConfig) -> list[LatencyResult]:
    from deltaserve.engine.core import EngineCore

    cells = bench_cells(args)
    engine = EngineCore(engine_config)
    collector = Collector()
    engine.start(collector)
    # Idle ticks capture prefill graphs one by one (seconds in all); a request that arrives meanwhile
    # waits for the capture in progress, and would time it.
    if not engine.wait_for_captures_ahead(CAPTURES_AHEAD_TIMEOUT_S):
        logger.warning("graph captures ahead of need still running after %.0f s", CAPTURES_AHEAD_TIMEOUT_S)
    results = []
    try:
        for input_len, output_len, bs in cells:
            for i in range(args.num_iters_warmup):
                run_iteration(engine, collector, bs, input_len, output_len, seed=1000 + i)
            runs = [
                run_iteration(engine, collector, bs, input_len, output_len, seed=i)
                for i in range(args.num_iters)
            ]
            # The median iteration: by TPOT, or by TTFT for prefill-only cells (one output token).
            key = (lambda r: r.tpot_ms) if output_len > 1 else (lambda r: r.ttft_ms)
            best = sorted(runs, key=key)[len(runs) // 2]
            results.append(best)
            print(
                f"batch {bs:4d}  in {input_len}  out {output_len}  TTFT {best.ttft_ms:9.2f} ms  "
                f"TPOT {best.tpot_ms:7.3f} ms  ITL p50/p99/max {best.itl_p50_ms:.2f}/{best.itl_p99_ms:.2f}/"
                f"{best.itl_max_ms:.2f} ms  {best.output_tok_s:9.1f} out tok/s",
                flush=True,
            )
        if collector.errors:
            raise RuntimeError(f"requests failed: {collector.errors[:3]}")
    finally:
        engine.shutdown("benchmark finished")
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({"engine": asdict(engine.info), "results": [asdict(r) for r in results]}, indent=2)
        )
    return results
