"""The 9B saturated cell's admission on an H100's KV pool, scheduler only (the fake backend of
tests/test_scheduler_fake_backend.py: no model, no device): 1,000 requests of 1024 in / 128 out sent as
512 clients free up, 29,159 pages of 16 tokens, 512 slots, the default step budgets, decode-ahead.

    python3 docs/benchmarks/2026-12-05-h100-saturated-9b-gate-long-startup/admission_sim.py

Prints, for optimistic admission (--kv-reserve-tokens 1) and the default reserve (256): preemptions,
steps, tokens fed (prompts recomputed after a preemption included), the most decode rows in a step, and
the steps' time under a linear model fitted to the H100 step log (8 ms + 28 us per token)."""

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import test_scheduler_fake_backend as fake  # noqa: E402

from deltaserve.cache.manager import CacheManager  # noqa: E402
from deltaserve.engine.protocol import AddRequest  # noqa: E402
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402

fake.PAGE = 16  # the fake backend checks each row's pages at this page size


def run(reserve: int, pages: int = 29159, n: int = 1000, clients: int = 512) -> dict[str, float]:
    done: set[str] = set()
    counts: dict[str, int] = defaultdict(int)

    def publish(out) -> None:
        for u in out.updates:
            counts[u.request_id] += len(u.new_token_ids)
            if u.finish_reason is not None:
                done.add(u.request_id)

    config = SchedulerConfig(
        max_model_len=262144,
        max_num_seqs=512,
        max_num_batched_tokens=2048,
        max_num_batched_tokens_saturated=512 + 4096,
        vocab_size=fake.VOCAB,
        decode_ahead=True,
        kv_reserve_tokens=reserve,
    )
    sched = Scheduler(
        config,
        fake.PositionBackend(),
        publish,
        cache=CacheManager(num_pages=pages, page_size=16, num_slots=513),
    )
    sent = 0
    while len(done) < n:
        while sent < n and sent - len(done) < clients:
            sched.submit(AddRequest(f"r{sent}", [1] * 1024, fake.greedy(128)))
            sent += 1
        sched.tick()
    assert all(counts[f"r{i}"] == 128 for i in range(n))
    tokens = [sum(len(r.token_ids) for r in p.rows) for p in sched.backend.plans]
    return {
        "preemptions": sched.num_preemptions,
        "steps": len(tokens),
        "tokens fed": sum(tokens),
        "most decode rows": max(len(p.decode) for p in sched.backend.plans),
        "modelled s": round(sum(8.0 + 0.028 * t for t in tokens) / 1000, 2),
    }


if __name__ == "__main__":
    for reserve in (1, 256):
        print(f"--kv-reserve-tokens {reserve}: {run(reserve)}")
