"""The 9B saturated cell's admission on an H100's KV pool, scheduler only (the fake backend of
tests/test_scheduler_fake_backend.py: no model, no device), with each request's time to first token
under a linear step-time model fitted to the H100 step log (8 ms + 28 us per token fed):
1,000 requests of 1024 in / 128 out sent as 512 clients free up, 29,159 pages of 16 tokens, 512 slots,
decode-ahead, the default step budgets and the tuned ones (8,192-token steps).

    python3 docs/benchmarks/2026-12-05-h100-saturated-9b-reserve-ab/admission_ttft_sim.py

Prints, for --kv-reserve-tokens 1 and 256 at the code's admission rule: preemptions, steps, the
modelled seconds of the run, and the median and mean modelled TTFT."""

import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import test_scheduler_fake_backend as fake  # noqa: E402

from deltaserve.cache.manager import CacheManager  # noqa: E402
from deltaserve.engine.protocol import AddRequest  # noqa: E402
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402

fake.PAGE = 16  # the fake backend checks each row's pages at this page size


def run(
    reserve: int, budget: int = 2048, saturated: int = 512 + 4096, pages: int = 29159
) -> dict[str, float]:
    n, clients = 1000, 512
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
        max_num_seqs=512,
        max_num_batched_tokens=budget,
        max_num_batched_tokens_saturated=saturated,
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
    sent = timed = 0
    while len(done) < n:
        while sent < n and sent - len(done) < clients:
            sched.submit(AddRequest(f"r{sent}", [1] * 1024, fake.greedy(128)))
            sent_at[f"r{sent}"] = clock
            sent += 1
        sched.tick()
        for plan in sched.backend.plans[timed:]:
            clock += (8.0 + 0.028 * sum(len(r.token_ids) for r in plan.rows)) / 1000
        timed = len(sched.backend.plans)
    assert all(counts[f"r{i}"] == 128 for i in range(n))
    ttft = [first_at[r] - sent_at[r] for r in sent_at]
    return {
        "preemptions": sched.num_preemptions,
        "steps": timed,
        "modelled s": round(clock, 2),
        "TTFT median s": round(statistics.median(ttft), 2),
        "TTFT mean s": round(statistics.mean(ttft), 2),
    }


if __name__ == "__main__":
    for reserve in (1, 256):
        print(f"--kv-reserve-tokens {reserve}: {run(reserve)}")
        print(f"--kv-reserve-tokens {reserve}, 8,192-token steps: {run(reserve, budget=8192, saturated=0)}")
