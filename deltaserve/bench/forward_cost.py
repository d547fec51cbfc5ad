"""`deltaserve bench forward`: what one forward of a given batch shape costs, in-process, for attribution.

A shape is rows of `SEQSxTOKENS@CONTEXT` joined by `+` (decode rows first, as a step lays them out):
`1x1@0` is a one-token prompt, `64x1@1100` 64 decode rows at context 1100, `61x1@1100+1x512@0` a
unified step. Every row reads and writes only the reserved page and state slot, so the numbers are
those of the kernels and the host work, not of any cached content; token ids are drawn from the
vocabulary, so a MoE model's experts get the spread of load that text gives them. For each shape, medians of
`--num-iters` runs after `--num-iters-warmup`:

- eager: the model's forward and logits, launched from Python (with --tensor-parallel-size N through
  rank 0's worker, so that every rank runs it: the kernel tables then show the all-reduces);
- worker: the engine's forward path (a decode graph when every row has one token and fits one, else a
  prefill graph when the step fits one: its first run captures it, inside the warm-up iterations);
- for each, the wall time (to the device's last kernel) and the host time (until the launch call
  returns). Host time close to wall time means the step is bound by launching, not by the GPU;
- with `--kernels N`, the N kernels with the most device time of each path (kernel_table.py): the eager
  forward's, then the worker's (inside its graph replays: what serving runs);
- with `--operators N`, the N torch operators of the eager forward whose kernels take the most device
  time, with their input shapes (which tensor a copy kernel moved).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deltaserve.bench.kernel_table import (
    KernelTime,
    OperatorTime,
    kernel_table_lines,
    operator_table_lines,
    profile_kernels,
    profile_operators,
)
from deltaserve.engine_config import EngineConfig

if TYPE_CHECKING:  # the engine (torch) is imported when the benchmark runs, not when the CLI parses
    from deltaserve.engine.core import EngineCore
    from deltaserve.ops.batch import BatchRow


@dataclass(frozen=True, slots=True)
class RowGroup:
    seqs: int
    tokens: int
    context: int


@dataclass(slots=True)
class ForwardCost:
    shape: str
    eager_wall_ms: float
    eager_host_ms: float
    worker_wall_ms: float
    worker_host_ms: float
    kernels: list[KernelTime] = field(default_factory=list)  # with --kernels: the eager forward's
    worker_kernels: list[KernelTime] = field(default_factory=list)  # with --kernels: the worker path's
    operators: list[OperatorTime] = field(default_factory=list)  # with --operators: the eager forward's


def parse_shape(text: str) -> list[RowGroup]:
    """'61x1@1100+1x512@0' -> [RowGroup(61, 1, 1100), RowGroup(1, 512, 0)]."""
    groups = []
    for part in text.split("+"):
        try:
            size, context = part.split("@")
            seqs, tokens = size.split("x")
            group = RowGroup(int(seqs), int(tokens), int(context))
        except ValueError:
            raise ValueError(f"--shape expects SEQSxTOKENS@CONTEXT[+...], got {text!r}") from None
        if group.seqs < 1 or group.tokens < 1 or group.context < 0:
            raise ValueError(f"--shape {text!r}: seqs and tokens must be >= 1, context >= 0")
        groups.append(group)
    return groups


def shape_rows(groups: Sequence[RowGroup], page_size: int, vocab_size: int, seed: int = 0) -> list[BatchRow]:
    """Rows on the reserved page and slot, with token ids drawn uniformly from the vocabulary (fixed
    seed): a MoE model routes them over its experts as it routes real text, where one repeated id would
    send every row to the same few experts and time the experts' kernels at an unreal load."""
    from deltaserve.engine.warmup import dummy_rows

    draw = random.Random(seed)
    rows: list[BatchRow] = []
    for g in groups:
        for row in dummy_rows(g.seqs, g.tokens, page_size, context=g.context):
            row.token_ids = [draw.randrange(vocab_size) for _ in row.token_ids]
            rows.append(row)
    return rows


def _median_times(
    run: Callable[[], object], sync: Callable[[], None], iters: int, warmup: int
) -> tuple[float, float]:
    """(wall ms, host ms) medians of `run`."""
    for _ in range(warmup):
        run()
    sync()
    walls, hosts = [], []
    for _ in range(iters):
        started = time.perf_counter()
        run()
        launched = time.perf_counter()
        sync()
        ended = time.perf_counter()
        walls.append((ended - started) * 1e3)
        hosts.append((launched - started) * 1e3)
    return statistics.median(walls), statistics.median(hosts)


def measure(
    engine: EngineCore, shape: str, iters: int, warmup: int, kernels: bool = False, operators: bool = False
) -> ForwardCost:
    import torch

    from deltaserve.ops.batch import build_forward_batch

    model, caches = engine.model, engine.backend.caches
    worker = engine.backend.worker
    device = model.device
    groups = parse_shape(shape)
    limit = engine.info.max_model_len
    if any(g.context + g.tokens > limit for g in groups):
        raise ValueError(f"--shape {shape!r}: a row's context + tokens exceeds max_model_len ({limit})")
    rows = shape_rows(groups, caches.page_size, engine.tokenizer_vocab)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def eager() -> object:
        if engine.workers is not None:  # rank 0's model alone would wait in its first all-reduce
            # the ranks run it too; under DELTASERVE_TP_GRAPHS=1 a step that fits a prefill graph replays it
            return worker.run(rows, decode_graphs=False)
        batch = build_forward_batch(rows, caches.page_size, device)
        return model.compute_logits(model(batch, caches.kv, caches.states))

    def through_worker() -> object:
        return worker.run(rows)

    with torch.inference_mode():
        eager_wall, eager_host = _median_times(eager, sync, iters, warmup)
        worker_wall, worker_host = _median_times(through_worker, sync, iters, warmup)
        on_gpu = device.type == "cuda"
        table = profile_kernels(eager, sync, iters, on_gpu) if kernels else []
        worker_table = profile_kernels(through_worker, sync, iters, on_gpu) if kernels else []
        operator_table = profile_operators(eager, sync, iters, on_gpu) if operators else []
    return ForwardCost(
        shape, eager_wall, eager_host, worker_wall, worker_host, table, worker_table, operator_table
    )


def add_bench_forward_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape",
        action="append",
        required=True,
        metavar="SEQSxTOKENS@CONTEXT[+...]",
        help="a batch shape (repeatable), e.g. --shape 1x1@0 --shape 64x1@1100 --shape 61x1@1100+1x512@0",
    )
    parser.add_argument("--num-iters", type=int, default=7)
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also profile each shape's eager forward and its worker path (graph replays) and list the "
        "N kernels of each with the most device time (CPU operators without a GPU)",
    )
    parser.add_argument(
        "--operators",
        type=int,
        default=0,
        metavar="N",
        help="also list the N torch operators of each shape's eager forward whose kernels take the most "
        "device time, with their input shapes",
    )


def run_bench_forward(args: argparse.Namespace, engine_config: EngineConfig) -> list[ForwardCost]:
    from deltaserve.engine.core import EngineCore

    for shape in args.shape:
        parse_shape(shape)  # a typo fails before the model loads
    engine = EngineCore(engine_config)
    # The forwards run on this thread: a started scheduler's idle ticks would capture prefill graphs
    # on the same device meanwhile, and a capture fails when another thread launches during it.
    engine.wait_for_startup_work()
    try:
        results = [
            measure(
                engine,
                s,
                args.num_iters,
                args.num_iters_warmup,
                kernels=args.kernels > 0,
                operators=args.operators > 0,
            )
            for s in args.shape
        ]
    finally:
        engine.shutdown("benchmark finished")
    print(
        f"{'shape':34s} {'eager wall':>10s} {'eager host':>10s} {'worker wall':>11s} {'worker host':>11s}  (ms)"
    )
    for r in results:
        print(
            f"{r.shape:34s} {r.eager_wall_ms:10.2f} {r.eager_host_ms:10.2f} "
            f"{r.worker_wall_ms:11.2f} {r.worker_host_ms:11.2f}"
        )
    for r in results:
        if r.kernels:
            print("\n".join(kernel_table_lines(f"{r.shape} (eager)", r.kernels, args.kernels)))
            print("\n".join(kernel_table_lines(f"{r.shape} (worker)", r.worker_kernels, args.kernels)))
        if r.operators:
            print("\n".join(operator_table_lines(f"{r.shape} (eager)", r.operators, args.operators)))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results
