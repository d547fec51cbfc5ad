"""The step-latency budget (--decode-latency-budget-ms): a step with decode rows prefills only what fits
the budget at the measured cost per prefill token. Pure policy with hand-computed values, then the
scheduler under a fake clock."""

from __future__ import annotations

import types

import pytest
import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.protocol import AddRequest
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig, steps
from deltaserve.engine.scheduler.plan import StepCost, cap_prefill_for_latency, observe_step_cost
from deltaserve.engine.step import PendingStep, StagedResult, StepPlan
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.sampling_params import SamplingParams


def test_the_cost_estimate_weights_sums_of_milliseconds_and_tokens():
    cost = observe_step_cost(StepCost(), 30.0, 1000)
    assert cost == StepCost(30.0, 1000.0) and cost.ms_per_token == pytest.approx(0.03)
    cost = observe_step_cost(cost, 20.0, 500)  # 0.8 * 30 + 0.2 * 20 = 28; 0.8 * 1000 + 0.2 * 500 = 900
    assert (cost.ms, cost.tokens) == pytest.approx((28.0, 900.0))
    assert observe_step_cost(cost, 50.0, 0) == cost  # a step without prefill says nothing of its cost
    assert StepCost().ms_per_token is None


def test_the_cap_fits_the_budget_above_a_quarter_of_the_step_tokens_and_a_16th_of_the_backlog():
    per_003 = StepCost(30.0, 1000.0)  # 0.03 ms per prefill token

    def cap(budget=2048, ms=24.0, cost=per_003, rows=8, backlog=0):
        return cap_prefill_for_latency(
            budget,
            latency_budget_ms=ms,
            cost=cost,
            num_decode_rows=rows,
            max_num_batched_tokens=2048,
            backlog_tokens=backlog,
        )

    assert cap() == 768  # 24 / 0.03 = 800, rounded down to a multiple of 128
    assert cap(ms=27.0) == 896  # 900 -> 896
    assert cap(backlog=8192) == 768  # 8192 / 16 = 512 is below what fits
    assert cap(backlog=16000) == 1024  # 16000 / 16 = 1000, rounded up: a backlog this deep prefills faster
    assert cap(backlog=16384) == 1024 and cap(backlog=16385) == 1152
    assert cap(backlog=64 * 1024) == 2048  # never past the step budget
    assert cap(ms=9.0) == 512  # 300 would fit: the floor is 2048 // 4
    assert cap(budget=300) == 300  # the step budget is smaller than what fits
    assert cap(ms=0.0) == 2048  # off
    assert cap(rows=0) == 2048  # no decoder waits on this step
    assert cap(cost=StepCost()) == 2048  # nothing measured yet


def test_sized_by_its_own_measurements_a_step_converges_to_the_budget():
    # Steps cost 10 ms of decode rows + 0.02 ms per prefill token; budget 30 ms: the fixed point is
    # 1000 prefill tokens (10 + 0.02 * 1000 = 30); in multiples of 128, 896 (at 896 the estimate fits
    # 30 * 896 / 27.92 = 963, which rounds back down to 896).
    cost, tokens = StepCost(), 2048
    for _ in range(60):
        cost = observe_step_cost(cost, 10.0 + 0.02 * tokens, tokens)
        tokens = cap_prefill_for_latency(
            2048, latency_budget_ms=30.0, cost=cost, num_decode_rows=16, max_num_batched_tokens=2048
        )
    assert tokens == 896


class ClockedBackend:
    """Each launch advances the fake clock by 10 ms plus 0.02 ms per prefill token; samples token 7."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.plans: list[StepPlan] = []

    def launch(self, plan: StepPlan) -> PendingStep:
        self.plans.append(plan)
        self.clock[0] += (10.0 + 0.02 * sum(len(r.token_ids) for r in plan.prefill)) / 1e3
        sampled = [r for r in plan.rows if r.sampling is not None]
        if not sampled:
            return PendingStep(None, None, [])
        tokens = torch.full((len(sampled),), 7)
        return PendingStep(tokens, StagedResult.start([tokens]), [r.sampling for r in sampled])


def _clocked_scheduler(monkeypatch, prompts: list[list[int]], max_num_seqs: int = 4):
    clock = [0.0]
    monkeypatch.setattr(steps, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    backend = ClockedBackend(clock)
    config = SchedulerConfig(
        max_model_len=4096,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        vocab_size=1000,
        decode_ahead=False,
        decode_latency_budget_ms=15.0,
    )
    cache = CacheManager(num_pages=2048, page_size=16, num_slots=max_num_seqs + 1)
    sched = Scheduler(config, backend, lambda out: None, cache=cache)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.submit(AddRequest(f"r{i}", prompt, params))
    for _ in range(3):
        sched.tick()
    return [[len(r.token_ids) for r in p.prefill] for p in backend.plans], [
        len(p.decode) for p in backend.plans
    ]


def test_the_scheduler_measures_unified_steps_and_cuts_the_next_chunk(monkeypatch):
    chunks, decode_rows = _clocked_scheduler(monkeypatch, [[1, 2, 3, 4], [10 + i % 900 for i in range(2000)]])
    # 1: both prompts start (4 + 508 = 512, no decoder yet: not measured); 2: the decoder's first
    # step beside 511 prompt tokens (nothing measured yet), 10 + 0.02 * 511 = 20.22 ms; 3: what fits
    # 15 ms at 20.22 / 511 ms a token: 379, rounded down to 256 (above the floors: 512 // 4 = 128
    # and the 1,481 tokens left / 16 = 93, 128 in multiples of 128).
    assert chunks == [[4, 508], [511], [256]]
    assert decode_rows == [0, 1, 1]


def test_a_deep_prefill_backlog_keeps_full_size_chunks(monkeypatch):
    # The same steps with five more 2000-token prompts queued behind: 11,481 tokens still to prefill
    # at step 3, a 16th of which (718, 768 in multiples of 128) is more than the step's budget, so the cut does not apply.
    long_prompts = [[10 + (i + j) % 900 for i in range(2000)] for j in range(6)]
    chunks, decode_rows = _clocked_scheduler(monkeypatch, [[1, 2, 3, 4], *long_prompts], max_num_seqs=8)
    assert chunks == [[4, 508], [511], [511]]
    assert decode_rows == [0, 1, 1]


def test_a_negative_budget_is_refused_naming_the_flag():
    with pytest.raises(
        ConfigError, match=r"--decode-latency-budget-ms must be a number of milliseconds >= 0"
    ):
        EngineConfig(decode_latency_budget_ms=-1.0).validate()
