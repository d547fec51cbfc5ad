"""Pure scheduling policy, against hand-computed expectations."""

from __future__ import annotations

import random

import pytest

from deltaserve.engine.scheduler import plan
from deltaserve.engine.scheduler.plan import (
    RETURN_LAG_STEPS,
    AdmissionCapacity,
    Holding,
    PendingView,
    PlanKind,
    RejectReason,
    admission_window,
    admit_pending_requests,
    build_next_plan,
    choose_prefill_budget,
    committed_pages,
    even_prefill_budget,
    is_saturated,
    max_kv_tokens,
    pages_for,
    plan_prefill_chunks,
    preemptions_needed,
    reserved_pages,
    step_token_budget,
)


def cap(**kw) -> AdmissionCapacity:
    base = dict(
        max_model_len=1000,
        page_size=16,
        capacity_pages=100,
        free_pages=100,
        committed_pages=0,
        free_slots=8,
        num_active=0,
        max_num_seqs=8,
    )
    base.update(kw)
    return AdmissionCapacity(**base)


@pytest.mark.parametrize(("tokens", "pages"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_pages_round_up_at_page_boundaries(tokens, pages):
    assert pages_for(tokens, 16) == pages


def test_the_last_sampled_token_never_occupies_kv():
    assert max_kv_tokens(prompt_len=10, max_tokens=1) == 10
    assert max_kv_tokens(prompt_len=10, max_tokens=7) == 16


def test_admission_is_fcfs_and_stops_at_the_first_request_that_does_not_fit():
    # 100 pages: 640 tokens take 40; 1000 tokens need 63 > the 60 left, so the small third waits too.
    pending = [PendingView(640, 10), PendingView(1000, 10), PendingView(16, 10)]
    decision = admit_pending_requests(pending, cap(max_model_len=2000))
    assert decision.admitted == (0,)
    assert decision.rejected == ()


def test_the_admission_window_is_the_new_arrivals_and_the_queue_head_by_hand():
    # checked: T, new: F. Two slots: the first three checked ones (one of them stays queued, blocking
    # the rest), and every new arrival wherever it stands (it may be impossible).
    checked = [True, True, False, True, True, True, False]
    assert admission_window(checked, 2) == [0, 1, 2, 3, 6]
    assert admission_window(checked, 0) == [0, 2, 6]  # no slot: the head blocks, arrivals are checked
    assert admission_window(checked, -1) == [2, 6]  # over max_num_seqs (a shrunk limit): arrivals only
    assert admission_window(checked, 9) == list(range(7))
    assert admission_window([], 3) == []


def test_context_length_rejection_takes_precedence_and_does_not_block():
    pending = [PendingView(990, 20), PendingView(16, 10)]  # 1010 > 1000 context window
    decision = admit_pending_requests(pending, cap(free_pages=0))  # even with no pages free
    assert [i for i, _ in decision.rejected] == [0]
    assert decision.rejected[0][1].reason is RejectReason.CONTEXT_LENGTH
    assert "prompt (990 tokens) + max_tokens (20) = 1010 exceeds the context window of 1000" in (
        decision.rejected[0][1].message
    )
    assert decision.admitted == ()  # the second waits for pages, it is not rejected


def test_a_request_that_can_never_fit_the_pool_is_rejected_and_later_ones_are_admitted():
    # lifetime = 500 + 400 - 1 = 899 tokens -> 57 pages > 50 capacity
    pending = [PendingView(500, 400), PendingView(100, 10)]
    decision = admit_pending_requests(pending, cap(capacity_pages=50, free_pages=50))
    assert decision.rejected[0][0] == 0
    assert decision.rejected[0][1].reason is RejectReason.KV_BUDGET
    assert (
        "needs 57 KV pages of 16 tokens, more than this instance holds (50)"
        in decision.rejected[0][1].message
    )
    assert decision.admitted == (1,)


def admitted(*pending: PendingView, **capacity) -> tuple[int, ...]:
    return admit_pending_requests(list(pending), cap(**capacity)).admitted


def test_committed_pages_are_not_available_to_new_prompts():
    # 20 free - 15 committed = 5 pages = 80 tokens
    assert admitted(PendingView(80, 5), free_pages=20, committed_pages=15) == (0,)
    assert admitted(PendingView(81, 5), free_pages=20, committed_pages=15) == ()


@pytest.mark.parametrize(
    ("num_tokens", "lifetime", "held", "reserve", "pages"),
    [
        (100, 10_000, 0, 1, 7),  # a prompt of 100: 100 positions, 7 pages of 16
        (100, 10_000, 0, 29, 8),  # then 28 more: 128 positions
        (100, 10_000, 0, 30, 9),  # 129
        (100, 110, 0, 256, 7),  # the reserve stops at the lifetime: 110 positions
        (101, 10_000, 7, 1, 0),  # a decoder holding 100 positions writes the 101st in its 7th page
        (113, 10_000, 7, 1, 1),  # at 112 it needs an 8th page
        (113, 10_000, 7, 256, 16),  # 112 + 256 = 368 positions: 23 pages, 16 beyond the 7 held
        (113, 120, 8, 256, 0),  # its lifetime fits in what it holds
    ],
)
def test_reserved_pages_by_hand(num_tokens, lifetime, held, reserve, pages):
    assert reserved_pages(num_tokens, lifetime, held, reserve, 16) == pages


# Pages of 16 tokens. OLD: 112 positions in 7 pages, lifetime 120: its 113th position takes an 8th page
# at step 1, its last token is sampled at step 8 and its 8 pages come back at step 10. MID: 100 positions
# in 7 pages, lifetime 200: a page more at steps 13, 29, ..., 93 (6 in all), its pages back at step 102.
# YOUNG: the same 100 positions, a lifetime past any reserve here: a page more every 16 steps from step 13.
OLD = Holding(num_tokens=113, lifetime_tokens=120, held_pages=7, sole_pages=7, lockstep=True)
MID = Holding(num_tokens=101, lifetime_tokens=200, held_pages=7, sole_pages=7, lockstep=True)
YOUNG = Holding(num_tokens=101, lifetime_tokens=10_000, held_pages=7, sole_pages=7, lockstep=True)
# OLD sharing 5 of its pages (a cached prefix another request holds, a state snapshot's page): it hands
# back its 2 own pages and the page it takes, 3 at step 10.
OLD_SHARING = Holding(num_tokens=113, lifetime_tokens=120, held_pages=7, sole_pages=2, lockstep=True)


@pytest.mark.parametrize(
    ("holdings", "reserve", "pages"),
    [
        ([OLD], 256, 1),  # one page until it returns its 8
        ([MID], 256, 6),
        ([YOUNG], 256, 16),  # positions 101..356: 23 pages
        # OLD's 8 pages are back at step 10, before MID takes its first (step 13): the most the two take
        # is OLD's page; summing their reserves would promise 1 + 6
        ([OLD, MID], 256, 1),
        # 3 back at step 10 (net -2), then MID's 6 pages at steps 13..93: net 4 at step 93
        ([OLD_SHARING, MID], 256, 4),
        # a request that outlives the reserve keeps all of it: OLD's return does not pay for YOUNG
        ([OLD, YOUNG], 256, 1 + 16),
        ([OLD, MID, YOUNG], 256, 1 + 16),
        # with a reserve too short to see them finish, each keeps its own: OLD's page, MID's none yet
        ([OLD, MID], 9, 1),
        ([MID], 50, 3),  # positions up to 150: 10 pages
        ([OLD, MID], 1, 1),  # the optimistic reserve: step 1 only
        # a holder that does not advance in lockstep (a prompt prefilling, drafts verified) keeps its reserve
        ([Holding(113, 120, 7, 7, lockstep=False), MID], 256, 1 + 6),
        ([], 256, 0),
    ],
)
def test_committed_pages_by_hand(holdings, reserve, pages):
    assert committed_pages(holdings, reserve, 16) == pages


def _finishes(h: Holding, within: int) -> bool:
    return h.lockstep and h.lifetime_tokens + 1 - h.num_tokens + RETURN_LAG_STEPS <= within


def _projected(holdings: list[Holding], reserve: int, page_size: int) -> int:
    """committed_pages by its definition: the reserves of the requests that outlive it, and the most the
    others take together, every step of the reserve."""
    finishing = [h for h in holdings if _finishes(h, reserve)]
    kept = _sum_of_reserves([h for h in holdings if not _finishes(h, reserve)], reserve, page_size)

    def net(step: int) -> int:
        total = 0
        for h in finishing:
            if step >= h.lifetime_tokens + 1 - h.num_tokens + RETURN_LAG_STEPS:
                total -= h.sole_pages
            else:
                total += reserved_pages(h.num_tokens, h.lifetime_tokens, h.held_pages, step, page_size)
        return total

    return kept + max([0] + [net(step) for step in range(1, reserve + 1)])


def _random_holdings(rng: random.Random, page_size: int) -> list[Holding]:
    holdings = []
    for _ in range(rng.randrange(6)):
        num_tokens = rng.randrange(1, 90)
        lifetime = num_tokens - 1 + rng.randrange(1, 70)
        full = pages_for(num_tokens - 1, page_size)  # a decoder's; a prompt prefilling holds fewer
        held = full if rng.random() < 0.7 else rng.randrange(full + 1)
        sole = held if rng.random() < 0.5 else rng.randrange(held + 1)
        holdings.append(Holding(num_tokens, lifetime, held, sole, lockstep=rng.random() < 0.6))
    return holdings


def _sum_of_reserves(holdings: list[Holding], reserve: int, page_size: int) -> int:
    return sum(
        reserved_pages(h.num_tokens, h.lifetime_tokens, h.held_pages, reserve, page_size) for h in holdings
    )


def test_committed_pages_follow_their_definition_step_by_step():
    rng = random.Random(7)
    for _ in range(3000):
        page_size = rng.choice([1, 4, 16])
        reserve = rng.choice([1, 2, 3, 17, 64, 200])
        holdings = _random_holdings(rng, page_size)
        got = committed_pages(holdings, reserve, page_size)
        assert got == _projected(holdings, reserve, page_size), (holdings, reserve, page_size)
        assert got <= _sum_of_reserves(holdings, reserve, page_size)


def test_past_the_projected_steps_committed_pages_stay_an_upper_bound(monkeypatch):
    monkeypatch.setattr(plan, "PROJECTED_STEPS", 8)
    rng = random.Random(8)
    for _ in range(2000):
        page_size = rng.choice([1, 4, 16])
        reserve = rng.choice([9, 30, 120])
        holdings = _random_holdings(rng, page_size)
        got = committed_pages(holdings, reserve, page_size)
        assert (
            _projected(holdings, reserve, page_size) <= got <= _sum_of_reserves(holdings, reserve, page_size)
        )


def test_admission_keeps_the_new_prompt_its_reserve_capped_at_its_max_tokens():
    # 10 free pages = 160 positions. A 100-token prompt with 256 max_tokens and a reserve of 64: 163
    # positions, 11 pages: waits; with 61 max_tokens its lifetime is 160 positions: admitted.
    assert admitted(PendingView(100, 256), free_pages=10, reserve_tokens=64) == ()
    assert admitted(PendingView(100, 61), free_pages=10, reserve_tokens=64) == (0,)
    # A reserve of 1 admits the prompt alone (7 pages), optimistically.
    assert admitted(PendingView(100, 256), free_pages=10, reserve_tokens=1) == (0,)
    # A preempted request recomputes its 20 outputs with the prompt: 120 + 63 = 183 positions, 12 pages.
    assert admitted(PendingView(100, 256, 20), free_pages=12, reserve_tokens=64) == (0,)
    assert admitted(PendingView(100, 256, 20), free_pages=11, reserve_tokens=64) == ()


def test_slots_and_max_num_seqs_bound_admission():
    pending = [PendingView(10, 5)] * 5
    assert admit_pending_requests(pending, cap(free_slots=8, num_active=6, max_num_seqs=8)).admitted == (0, 1)
    assert admit_pending_requests(pending, cap(free_slots=3, num_active=0, max_num_seqs=8)).admitted == (
        0,
        1,
        2,
    )


def test_preempted_request_readmits_with_its_outputs_recomputed():
    # 100 prompt + 40 outputs = 140 tokens to recompute = 9 pages
    assert admit_pending_requests([PendingView(100, 50, num_output=40)], cap(free_pages=9)).admitted == (0,)
    assert admit_pending_requests([PendingView(100, 50, num_output=40)], cap(free_pages=8)).admitted == ()


def test_chunks_pack_short_prompts_and_only_the_last_is_partial():
    assert plan_prefill_chunks([5, 3, 10, 4], budget=12) == [5, 3, 4]
    assert plan_prefill_chunks([5, 3], budget=100) == [5, 3]
    assert plan_prefill_chunks([50, 3], budget=7) == [7]
    assert plan_prefill_chunks([5, 3], budget=0) == []
    assert plan_prefill_chunks([5, 3], budget=5) == [5]


def test_a_lone_prompts_chunks_are_evened_over_the_fewest_steps_in_graph_buckets():
    # 8192 tokens beside 4 decoders, 2044 a step: 5 steps (4 x 2044 = 8176 < 8192); 8192 / 5 -> 1639,
    # + 4 rows = 1643, rounded up to 1664 tokens: 1660. Packed: 2044 x 4 and a 16-token tail.
    assert even_prefill_budget(2044, 8192, 4) == 1660
    assert even_prefill_budget(2044, 8192 - 4 * 1660, 4) == 2044  # the last 1552 fit one step
    assert even_prefill_budget(2044, 6532, 4) == 1660  # 4 steps: 1633 -> 1637 -> 1664
    assert even_prefill_budget(2044, 4088, 4) == 2044  # exactly 2 full steps
    assert even_prefill_budget(2044, 4100, 4) == 1404  # 3 steps: 1367 -> 1371 -> 1408
    assert even_prefill_budget(2044, 1000, 4) == 2044  # one step: the budget stays
    assert even_prefill_budget(0, 500, 4) == 0
    assert even_prefill_budget(511, 1200, 1) == 511  # 3 steps of 400 -> 401 -> 512: never past the budget


def test_a_server_becomes_saturated_while_requests_queue():
    def saturated(waiting: int, prefilling: int, seqs: int = 512) -> bool:
        return is_saturated(
            was_saturated=False, num_waiting=waiting, num_prefilling=prefilling, max_num_seqs=seqs
        )

    assert saturated(waiting=1, prefilling=0)  # a request waits for admission
    assert not saturated(waiting=0, prefilling=0)
    assert not saturated(waiting=0, prefilling=64)  # 64 of 512 slots: an eighth, not more
    assert saturated(waiting=0, prefilling=65)
    assert saturated(waiting=0, prefilling=33, seqs=256)  # more than 256 / 8 = 32
    assert not saturated(waiting=0, prefilling=32, seqs=256)
    assert not saturated(waiting=0, prefilling=8, seqs=16)  # never for 8 or fewer
    assert saturated(waiting=0, prefilling=9, seqs=16)
    assert saturated(waiting=1, prefilling=0, seqs=4)


def test_a_saturated_server_stays_saturated_until_eight_or_fewer_wait_for_prefill():
    def after(prefilling: list[int], seqs: int = 512) -> list[bool]:
        state, seen = False, []
        for n in prefilling:
            state = is_saturated(was_saturated=state, num_waiting=0, num_prefilling=n, max_num_seqs=seqs)
            seen.append(state)
        return seen

    # Enters above 64 of 512, stays down to 9, leaves at 8, and enters again only above 64.
    assert after([60, 65, 40, 9, 8, 40, 65]) == [False, True, True, True, False, False, True]
    # At 64 slots or fewer the bars are the same (max(64 / 8, 8) = 8).
    assert after([9, 8, 9], seqs=64) == [True, False, True]
    # Requests waiting for admission keep it saturated whatever the queue.
    assert is_saturated(was_saturated=True, num_waiting=3, num_prefilling=0, max_num_seqs=512)


def test_the_saturated_step_budget_applies_only_to_saturated_steps():
    assert step_token_budget(2048, 8192, saturated=True) == 8192
    assert step_token_budget(2048, 8192, saturated=False) == 2048
    assert step_token_budget(2048, 0, saturated=True) == 2048  # off
    assert step_token_budget(2048, 1024, saturated=True) == 2048  # never below the base budget


def test_fcfs_budget_subtracts_decode_rows():
    kw = dict(decode_tokens_left=[3, 100], front_remaining=500)
    assert choose_prefill_budget(policy="fcfs", max_num_batched_tokens=64, num_decode_rows=2, **kw) == 62
    assert choose_prefill_budget(policy="fcfs", max_num_batched_tokens=1, num_decode_rows=2, **kw) == 0


def test_auto_budget_skips_prefill_when_a_decoder_is_about_to_finish():
    assert (
        choose_prefill_budget(
            policy="auto",
            max_num_batched_tokens=64,
            num_decode_rows=2,
            decode_tokens_left=[4, 90],
            front_remaining=500,
        )
        == 0
    )
    assert (
        choose_prefill_budget(
            policy="auto",
            max_num_batched_tokens=64,
            num_decode_rows=2,
            decode_tokens_left=[5, 90],
            front_remaining=500,
        )
        == 62
    )
    # shrinks to what the front request needs, never above the base budget
    assert (
        choose_prefill_budget(
            policy="auto",
            max_num_batched_tokens=64,
            num_decode_rows=2,
            decode_tokens_left=[5, 90],
            front_remaining=20,
        )
        == 20
    )
    # with no decoder there is nothing to protect
    assert (
        choose_prefill_budget(
            policy="auto",
            max_num_batched_tokens=64,
            num_decode_rows=0,
            decode_tokens_left=[],
            front_remaining=500,
        )
        == 64
    )


def test_preemption_takes_the_fewest_newest_requests():
    # three decoders each holding 4 pages needing 1 more; one free page
    demands = [(4, 1), (4, 1), (4, 1)]
    assert preemptions_needed(3, demands) == 0
    assert preemptions_needed(1, demands) == 1  # newest frees 4 and drops its own need: 2 <= 1 + 4
    assert preemptions_needed(0, [(4, 1), (2, 1)]) == 1  # the victim's own need goes with it: 1 <= 0 + 2
    assert preemptions_needed(0, [(4, 1), (0, 1)]) == 2  # a victim holding nothing frees nothing
    assert preemptions_needed(0, [(1, 1)]) == 1  # the oldest alone can be preempted (caller requeues it)


def test_plan_kind_follows_what_is_scheduled():
    assert build_next_plan(3, 2) is PlanKind.UNIFIED
    assert build_next_plan(0, 2) is PlanKind.PREFILL
    assert build_next_plan(3, 0) is PlanKind.DECODE
    assert build_next_plan(0, 0) is None


def test_a_chunk_ends_at_its_requests_cache_point_and_planning_goes_on():
    # budget 20: request 0 stops at its point after 6 tokens, request 1 (no point) takes 10 whole,
    # request 2 stops at its point after 3, and the budget cuts nothing.
    assert plan_prefill_chunks([8, 10, 9], 20, [6, None, 3]) == [6, 10, 3]
    # the budget cuts request 1 short of its point: it is the last chunk planned
    assert plan_prefill_chunks([8, 10, 9], 12, [6, 9, None]) == [6, 6]
    # a point at or past the end of the pending tokens changes nothing
    assert plan_prefill_chunks([5, 4], 64, [5, 7]) == [5, 4]


def test_cached_pages_that_others_already_hold_cost_no_free_page():
    views = [PendingView(64, 8), PendingView(64, 8)]  # 5 pages of 16 each (64 + 8 - 1 -> 72 positions)
    plain = admit_pending_requests(views, cap(free_pages=6))
    assert plain.admitted == (0,)  # 4 pages each for the 64-token prompt: the second does not fit
    cached = {0: 0, 1: 3}  # request 1 shares 3 referenced pages: it needs only 1 more
    shared = admit_pending_requests(views, cap(free_pages=6), lambda i: cached[i])
    assert shared.admitted == (0, 1)


def test_cached_pages_are_asked_for_only_up_to_the_first_request_that_blocks():
    asked = []
    views = [PendingView(16, 1)] * 4
    decision = admit_pending_requests(views, cap(free_pages=2), lambda i: asked.append(i) or 0)
    assert decision.admitted == (0, 1) and asked == [0, 1, 2]
