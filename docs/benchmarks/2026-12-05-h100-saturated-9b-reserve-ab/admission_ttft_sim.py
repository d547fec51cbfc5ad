"""Admission on a KV pool, scheduler only (the fake backend of tests/test_scheduler_fake_backend.py: no
model, no device), with each request's time to first token under a linear step-time model fitted to the
H100 step log (8 ms + 28 us per token fed), for the code's admission rule and for the summed reserves
(b5f17ac: every request keeps its own reserve):

- the 9B saturated cell on an H100's pool: 1,000 requests of 1024 in / 128 out sent as 512 clients free
  up, 29,159 pages of 16 tokens, 512 slots, decode-ahead, the default step budgets and the tuned ones
  (8,192-token steps);
- a mixed workload whose outputs often outlive the reserve: 600 requests of 50-3,000 prompt tokens and
  8-64, 64-600 or 4,000 output tokens (a third each), 256 clients and slots, 3,000 or 8,000 pages.

    python3 docs/benchmarks/2026-12-05-h100-saturated-9b-reserve-ab/admission_ttft_sim.py

Prints preemptions, steps, the modelled seconds of the run, and the median and mean modelled TTFT."""

import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import test_scheduler_fake_backend as fake  # noqa: E402

from deltaserve.cache.manager import CacheManager  # noqa: E402
from deltaserve.engine.protocol import AddRequest  # noqa: E402
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig, plan, steps  # noqa: E402

fake.PAGE = 16  # the fake backend checks each row's pages at this page size
CODE_RULE = steps.committed_pages


def summed_reserves(holdings, reserve_tokens: int, page_size: int) -> int:
    return sum(
        plan.reserved_pages(h.num_tokens, h.lifetime_tokens, h.held_pages, reserve_tokens, page_size)
        for h in holdings
    )


def saturated_cell() -> list[tuple[int, int]]:
    return [(1024, 128)] * 1000


def mixed_workload(seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [
        (rng.randint(50, 3000), rng.choice([rng.randint(8, 64), rng.randint(64, 600), 4000]))
        for _ in range(600)
    ]


def run(
    requests: list[tuple[int, int]],
    reserve: int,
    *,
    rule=CODE_RULE,
    seqs: int = 512,
    budget: int = 2048,
    saturated: int | None = None,
    pages: int = 29159,
) -> dict[str, float]:
    steps.committed_pages = rule
    n = len(requests)
    done: set[str] = set()
    counts: dict[str, int] = defaultdict(int)
    sent_at: dict[str, float] = {}
    first_at: dict[str, float] = {}
    clock = 0.0

    def publish(out) -> None:
        for u in out.updates:
            if u.new_token_ids and u.request_id not in first_at:
                first_at[u.request_id] = clock
            counts[u.request_id] += len(u.new_token_ids)
            if u.finish_reason is not None:
                done.add(u.request_id)

    config = SchedulerConfig(
        max_model_len=262144,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_num_batched_tokens_saturated=seqs + 4096 if saturated is None else saturated,
        vocab_size=fake.VOCAB,
        decode_ahead=True,
        kv_reserve_tokens=reserve,
    )
    cache = CacheManager(num_pages=pages, page_size=16, num_slots=seqs + 1)
    sched = Scheduler(config, fake.PositionBackend(), publish, cache=cache)
    sent = timed = 0
    while len(done) < n:
        while sent < n and sent - len(done) < seqs:
            prompt_len, max_tokens = requests[sent]
            sched.submit(AddRequest(f"r{sent}", [1] * prompt_len, fake.greedy(max_tokens)))
            sent_at[f"r{sent}"] = clock
            sent += 1
        sched.tick()
        for step in sched.backend.plans[timed:]:
            clock += (8.0 + 0.028 * sum(len(r.token_ids) for r in step.rows)) / 1000
        timed = len(sched.backend.plans)
    assert all(counts[f"r{i}"] == requests[i][1] for i in range(n))
    ttft = [first_at[r] - sent_at[r] for r in sent_at]
    return {
        "preemptions": sched.num_preemptions,
        "steps": timed,
        "modelled s": round(clock, 2),
        "TTFT median s": round(statistics.median(ttft), 2),
        "TTFT mean s": round(statistics.mean(ttft), 2),
    }


if __name__ == "__main__":
    rules = (("returns counted", CODE_RULE), ("summed", summed_reserves))
    cell = saturated_cell()
    for label, rule in rules:
        print(f"saturated cell, reserve 256, {label}: {run(cell, 256, rule=rule)}", flush=True)
        tuned = run(cell, 256, rule=rule, budget=8192, saturated=0)
        print(f"saturated cell, reserve 256, {label}, 8,192-token steps: {tuned}", flush=True)
    print(f"saturated cell, reserve 1: {run(cell, 1)}", flush=True)
    print(
        f"saturated cell, reserve 1, 8,192-token steps: {run(cell, 1, budget=8192, saturated=0)}", flush=True
    )
    for seed in range(3):
        for pages in (3000, 8000):
            for label, rule in rules:
                stats = run(mixed_workload(seed), 256, rule=rule, seqs=256, pages=pages)
                print(f"mixed workload {seed}, {pages} pages, {label}: {stats}", flush=True)
