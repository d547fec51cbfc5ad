"""Host time per scheduler tick with presence-penalised requests, over a backend without a model.

The scheduler plans, launches and dispatches as in serving; the worker fills the decode graphs' input
buffers and returns zero logits over a 1,000-token vocabulary, so what is timed is the host's work per
step (planning, input building, sampling on the CPU, dispatch, message encoding).

    python3 docs/benchmarks/2026-12-04-cpu-penalty-counts/host_cost.py --rows 64

`--greedy` times greedy rows instead (no penalties, no sampling arithmetic: the host's own work).
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.backend import Backend
from deltaserve.engine.cuda_graphs import fill_decode_inputs
from deltaserve.engine.protocol import AddRequest, encode_engine_message
from deltaserve.engine.sampler import Sampler
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig
from deltaserve.sampling_params import SamplingParams

VOCAB, PAGE, MAX_LEN = 1000, 16, 16384


class NoModel:
    mtp = None
    device = torch.device("cpu")


class NoModelWorker:
    """Fills the decode graphs' inputs of a step of one-token rows, returns zero logits."""

    prefill_graphs = None

    def __init__(self, rows: int) -> None:
        self.longs = np.zeros((4, rows), np.int64)
        self.ints = np.zeros(2 * rows + rows * (MAX_LEN // PAGE), np.int32)

    def run(self, rows, fed=None, *, logits=True, copies_before=(), copies_after=(), decode_graphs=True):
        if all(len(r.token_ids) == 1 for r in rows):
            fill_decode_inputs(self.longs, self.ints, rows, len(rows), PAGE)
        return torch.zeros(sum(r.need_logits for r in rows), VOCAB), None

    def capture_ahead(self) -> bool:
        return False


def sampler(rows: int) -> Sampler:
    try:  # the device-counted penalties' rows, where this checkout has them
        from deltaserve.engine.penalty_counts import PenaltyCounts
    except ImportError:
        return Sampler()
    return Sampler(PenaltyCounts(rows + 1, VOCAB, torch.device("cpu")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--greedy", action="store_true", help="greedy rows, without penalties")
    parser.add_argument("--prompt-len", type=int, default=1024)
    args = parser.parse_args()
    n = args.rows
    config = SchedulerConfig(
        max_model_len=MAX_LEN, max_num_seqs=n, max_num_batched_tokens=8192, vocab_size=VOCAB
    )
    backend = Backend(NoModel(), None, sampler=sampler(n), worker=NoModelWorker(n))
    scheduler = Scheduler(
        config,
        backend,
        lambda out: encode_engine_message(out),
        cache=CacheManager(num_pages=n * 700, page_size=PAGE, num_slots=n + 1),
    )
    params = (
        SamplingParams(temperature=0.0, max_tokens=9000, ignore_eos=True)
        if args.greedy
        else SamplingParams(
            temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, max_tokens=9000, ignore_eos=True
        )
    )
    for i in range(n):
        scheduler.submit(AddRequest(f"r{i}", [j % 900 for j in range(args.prompt_len)], params))
    for _ in range(300):  # the prompts prefilled
        scheduler.tick()
    gc.collect()
    gc.freeze()
    for _ in range(args.rounds):
        for _ in range(1000):
            scheduler.tick()
        started = time.perf_counter()
        for _ in range(50):
            scheduler.tick()
        outputs = len(scheduler.running[0].output_token_ids) if scheduler.running else 0
        print(
            f"{n} rows, ~{outputs} output tokens each: {(time.perf_counter() - started) / 50 * 1e3:.2f} ms per tick"
        )


if __name__ == "__main__":
    main()
