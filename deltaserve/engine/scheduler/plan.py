"""Pure scheduling policy: admission, prefill budget, chunk planning, preemption, plan kind.

Nothing here touches torch, the caches or a request object: every function maps plain numbers (views of
the scheduler's state) to a decision, so each rule is tested with hand-computed expectations.

KV policy: admission with a growth reserve, and recompute preemption. A request is admitted when its
prompt and its next `reserve_tokens` tokens fit the pages not already promised to admitted requests: the
rest of their prompts and their own next `reserve_tokens` tokens, each capped at what its max_tokens can
still take, where the decoders that finish within the reserve count the pages they return as they
finish (`committed_pages`). Decode growth takes pages one at a time, and when a step cannot
get them, the newest requests are preempted (their pages and state slot freed, their tokens recomputed
later). The reserve makes preemption rare where requests finish within it; a reserve of 1 token admits
optimistically. The oldest request always makes progress, and every admitted request fits the pool alone
(`KV_BUDGET` rejects the rest), so nothing livelocks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

# Under the `auto` policy a tick whose decoders include one this close to its max_tokens runs decode only.
DECODE_FINISH_WINDOW_TOKENS = 4


def _nothing_cached(index: int) -> int:
    return 0


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def max_kv_tokens(prompt_len: int, max_tokens: int) -> int:
    """KV positions a request can ever occupy: the last sampled token is never fed back."""
    return prompt_len + max_tokens - 1


def reserved_pages(
    num_tokens: int, lifetime_tokens: int, held_pages: int, reserve_tokens: int, page_size: int
) -> int:
    """Pages a request (`num_tokens`: prompt + outputs so far) still takes to hold its next
    `reserve_tokens` tokens, beyond the `held_pages` it has: a prompt's prefill samples the first of them,
    and each feeds back the one before, so it then holds num_tokens + reserve_tokens - 1 KV positions, never
    more than `lifetime_tokens` (max_kv_tokens). A decoder holds num_tokens - 1 and feeds the last one
    next: the same count."""
    target = min(num_tokens + reserve_tokens - 1, lifetime_tokens)
    return max(0, pages_for(target, page_size) - held_pages)


# A finished request's pages return to the pool this many steps after the step that sampled its last
# token: a step launched ahead is read, and its finished requests retired, one step late.
RETURN_LAG_STEPS = 2
# Returns are projected only for requests that finish within this many steps (a bound on the host work:
# a page event per request every page_size steps); a later one keeps its whole reserve.
PROJECTED_STEPS = 1024


@dataclass(frozen=True, slots=True)
class Holding:
    """An admitted request's KV pages, as admission projects them."""

    num_tokens: int  # prompt + outputs so far
    lifetime_tokens: int  # max_kv_tokens: the most KV positions it can ever occupy
    held_pages: int
    # Of those, the pages it alone holds (not a prefix shared with another request, not a state
    # snapshot's): with the pages it takes later, what it hands back when it finishes. Read only for a
    # lockstep decoder that `returns_within` the reserve.
    sole_pages: int
    # A decoder fed one token every step (every running request when no drafts are verified): it returns
    # its pages RETURN_LAG_STEPS steps after it reaches its lifetime. Any other (a prompt still
    # prefilling, a decoder advanced by accepted drafts at its own rate) is taken to keep its pages.
    lockstep: bool


def return_step(num_tokens: int, lifetime_tokens: int) -> int:
    """The step, counted from the next one (1), whose admission sees a lockstep decoder's pages back."""
    return lifetime_tokens + 1 - num_tokens + RETURN_LAG_STEPS


def returns_within(num_tokens: int, lifetime_tokens: int, reserve_tokens: int) -> bool:
    """Whether admission counts a lockstep decoder's pages as coming back within the reserve."""
    return return_step(num_tokens, lifetime_tokens) <= min(reserve_tokens, PROJECTED_STEPS)


def committed_pages(holdings: Sequence[Holding], reserve_tokens: int, page_size: int) -> int:
    """Pages the admitted requests may still take beyond those they hold, within their next
    `reserve_tokens` tokens. A request that outlives the reserve (or is not a lockstep decoder) keeps its
    whole `reserved_pages`: its growth goes on past the reserve, and the pages kept in its name are what
    absorb that until it finishes. The lockstep decoders that finish within the reserve count together:
    the most they take at any step t, each holding min(num_tokens + t - 1, lifetime) positions until it
    hands back the pages it alone holds (`return_step`). So the old requests' pages, which come back
    soon, pay for the young ones' later growth instead of being promised twice."""
    kept = 0
    change: dict[int, int] = defaultdict(int)  # step -> change of the finishing requests' net pages
    for h in holdings:
        if not (h.lockstep and returns_within(h.num_tokens, h.lifetime_tokens, reserve_tokens)):
            kept += reserved_pages(h.num_tokens, h.lifetime_tokens, h.held_pages, reserve_tokens, page_size)
            continue
        grown = reserved_pages(h.num_tokens, h.lifetime_tokens, h.held_pages, 1, page_size)
        change[1] += grown
        # the steps whose position starts a page: each takes one more (once past the pages held)
        position = pages_for(min(h.num_tokens, h.lifetime_tokens), page_size) * page_size + 1
        while position <= h.lifetime_tokens:
            taken = max(0, pages_for(position, page_size) - h.held_pages)
            change[position - h.num_tokens + 1] += taken - grown
            grown = taken
            position += page_size
        change[return_step(h.num_tokens, h.lifetime_tokens)] -= grown + h.sole_pages
    peak = net = 0
    for step in sorted(change):
        net += change[step]
        peak = max(peak, net)
    return kept + peak


class RejectReason(Enum):
    CONTEXT_LENGTH = "context_length"
    KV_BUDGET = "kv_budget"


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: RejectReason
    message: str


@dataclass(frozen=True, slots=True)
class PendingView:
    prompt_len: int  # the request's prompt
    max_tokens: int  # resolved: never None here
    num_output: int = 0  # tokens generated before a preemption; recomputed with the prompt


@dataclass(frozen=True, slots=True)
class AdmissionCapacity:
    max_model_len: int
    page_size: int
    capacity_pages: int  # pages the pool can ever hand out
    free_pages: int
    # Pages admitted requests will still take (`committed_pages`): the rest of their prompts and their next
    # reserve_tokens tokens, the decoders finishing within them net of what they return.
    committed_pages: int
    free_slots: int
    num_active: int  # requests holding a slot (prefilling or decoding)
    max_num_seqs: int
    reserve_tokens: int = 1  # each request's next tokens whose pages admission keeps (>= 1)


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    admitted: tuple[int, ...]  # indices into the pending list, FIFO order
    rejected: tuple[tuple[int, Rejection], ...]
    # every other pending request stays queued, in order


def admission_slots(cap: AdmissionCapacity) -> int:
    """How many requests admission may start now: free state slots, within max_num_seqs."""
    return min(cap.free_slots, cap.max_num_seqs - cap.num_active)


def admit_pending_requests(
    pending: Sequence[PendingView],
    cap: AdmissionCapacity,
    cached_pages: Callable[[int], int] = _nothing_cached,
) -> AdmissionDecision:
    """FCFS admission. Impossible requests are rejected whatever their position and never block later
    ones; the first request that cannot be admitted now blocks every later one (strict FCFS).
    `cached_pages(i)`: pages of request i's cached prefix that other holders already reference (they
    cost no free page); asked only for the requests whose fit is checked, in order."""
    admitted: list[int] = []
    rejected: list[tuple[int, Rejection]] = []
    page_budget = cap.free_pages - cap.committed_pages
    slot_budget = admission_slots(cap)
    blocked = False
    for i, req in enumerate(pending):
        rejection = _impossible(req, cap)
        if rejection is not None:
            rejected.append((i, rejection))
            continue
        if blocked:
            continue
        if len(admitted) >= slot_budget:
            blocked = True
            continue
        lifetime = max_kv_tokens(req.prompt_len, req.max_tokens)
        num_tokens = req.prompt_len + req.num_output
        need = reserved_pages(num_tokens, lifetime, 0, cap.reserve_tokens, cap.page_size) - cached_pages(i)
        if need > page_budget:
            blocked = True
            continue
        admitted.append(i)
        page_budget -= need
    return AdmissionDecision(tuple(admitted), tuple(rejected))


def admission_window(checked: Sequence[bool], slot_budget: int) -> list[int]:
    """Indices of the queued requests (FIFO order; checked[i]: request i passed the impossibility checks
    at an earlier admission, and they never change for it) that admission must look at: every one not
    checked yet, wherever it stands, and the first slot_budget + 1 checked ones. At most slot_budget are
    admitted, so among those checked ones one is not, and it blocks every later one (strict FCFS): a
    long queue costs admission its new arrivals and its head, not its length."""
    window: list[int] = []
    heads = 0
    for i, done in enumerate(checked):
        if not done:
            window.append(i)
        elif heads <= slot_budget:
            window.append(i)
            heads += 1
    return window


def _impossible(req: PendingView, cap: AdmissionCapacity) -> Rejection | None:
    total = req.prompt_len + req.max_tokens
    if total > cap.max_model_len:
        return Rejection(
            RejectReason.CONTEXT_LENGTH,
            f"prompt ({req.prompt_len} tokens) + max_tokens ({req.max_tokens}) = {total} exceeds the context "
            f"window of {cap.max_model_len} tokens; lower max_tokens or shorten the prompt",
        )
    lifetime = pages_for(max_kv_tokens(req.prompt_len, req.max_tokens), cap.page_size)
    if lifetime > cap.capacity_pages:
        return Rejection(
            RejectReason.KV_BUDGET,
            f"prompt ({req.prompt_len} tokens) + max_tokens ({req.max_tokens}) needs {lifetime} KV pages of "
            f"{cap.page_size} tokens, more than this instance holds ({cap.capacity_pages}); lower max_tokens",
        )
    return None


# The server becomes saturated while more than max_num_seqs / SATURATED_PREFILL_QUEUE_SHARE admitted
# requests, and more than SATURATED_MIN_PREFILL_QUEUE, wait for their prefill: a burst of one request per
# client (64 clients on 512 slots) is not, nor a few prompts on a server of a few slots. It stays
# saturated until no more than SATURATED_MIN_PREFILL_QUEUE wait.
SATURATED_PREFILL_QUEUE_SHARE = 8
SATURATED_MIN_PREFILL_QUEUE = 8


def is_saturated(*, was_saturated: bool, num_waiting: int, num_prefilling: int, max_num_seqs: int) -> bool:
    """Whether this step counts as saturated: requests wait for admission, or more than
    max(max_num_seqs / SATURATED_PREFILL_QUEUE_SHARE, SATURATED_MIN_PREFILL_QUEUE) admitted requests wait
    for their prefill, or the last step was saturated and more than SATURATED_MIN_PREFILL_QUEUE still
    wait. The lower bar to stay makes a wave of admissions (the sequences that finished together) prefill
    in large steps down to its last few prompts, not only down to the bar to enter, below which its
    remaining ~max_num_seqs / 8 prompts would take steps of max_num_batched_tokens. On a server of at
    most 64 slots the two bars are the same."""
    if num_waiting > 0:
        return True
    enter = max(max_num_seqs / SATURATED_PREFILL_QUEUE_SHARE, SATURATED_MIN_PREFILL_QUEUE)
    return num_prefilling > (SATURATED_MIN_PREFILL_QUEUE if was_saturated else enter)


def step_token_budget(max_num_batched_tokens: int, saturated_tokens: int, *, saturated: bool) -> int:
    """This step's token budget (decode rows + prefill): `saturated_tokens` when it is set and the server
    is saturated (`is_saturated`), else max_num_batched_tokens. A saturated server's queued first tokens
    depend on prefill throughput, and each larger step carries more prompt tokens per pass over the
    weights; the queue keeps the slots full, so the decode rows grow with it. Below that load the smaller
    budget keeps steps short."""
    if saturated and saturated_tokens > max_num_batched_tokens:
        return saturated_tokens
    return max_num_batched_tokens


def choose_prefill_budget(
    *,
    policy: str,
    max_num_batched_tokens: int,
    num_decode_rows: int,
    decode_tokens_left: Sequence[int],
    front_remaining: int | None,
) -> int:
    """Prefill tokens for this step. Decode rows are always scheduled and count against the token budget.
    `auto` runs a decode-only tick when a decoder is within DECODE_FINISH_WINDOW_TOKENS of max_tokens (so
    it finishes without a prefill stall) and otherwise never plans more than the front request needs."""
    budget = max(0, max_num_batched_tokens - num_decode_rows)
    if policy == "fcfs" or num_decode_rows == 0 or front_remaining is None:
        return budget
    if any(left <= DECODE_FINISH_WINDOW_TOKENS for left in decode_tokens_left):
        return 0
    return min(front_remaining, budget)


# The step-latency budget (--decode-latency-budget-ms): weight of one step in the running cost estimate,
# and the shares a step with decode rows prefills whatever the estimate says: a quarter of the token
# budget (prefill always progresses, however long the decode rows alone take) and a 16th of the prompt
# tokens waiting (a burst of prompts, or a server whose queue grows, prefills at the step budget's full
# size: there every waiting request's first token depends on prefill throughput).
STEP_COST_SMOOTHING = 0.2
MIN_PREFILL_SHARE = 4  # at least max_num_batched_tokens // MIN_PREFILL_SHARE prefill tokens
BACKLOG_PREFILL_SHARE = 16  # at least ceil(backlog / BACKLOG_PREFILL_SHARE) prefill tokens
# What fits the budget is rounded down to a multiple of this (the backlog's share up), so a cut step fills
# a prefill graph's token bucket (they are 128 apart above 512) and the steps it cuts share few buckets.
LATENCY_CUT_GRAIN = 128


@dataclass(frozen=True, slots=True)
class StepCost:
    """Running estimate of what a step with prefill costs per prefill token: exponentially weighted
    sums of measured step milliseconds and of their prefill tokens. The decode rows' share is folded
    in, so sizing chunks by it converges to steps of the budget: a step of T tokens that took
    a + b T ms gives T' = budget * T / (a + b T), whose fixed point is a + b T = budget."""

    ms: float = 0.0
    tokens: float = 0.0

    @property
    def ms_per_token(self) -> float | None:
        return self.ms / self.tokens if self.tokens > 0 else None


def observe_step_cost(cost: StepCost, step_ms: float, prefill_tokens: int) -> StepCost:
    """The estimate after a step with `prefill_tokens` prefill tokens that took `step_ms`."""
    if prefill_tokens <= 0:
        return cost
    if cost.tokens <= 0:
        return StepCost(step_ms, float(prefill_tokens))
    keep = 1.0 - STEP_COST_SMOOTHING
    return StepCost(
        keep * cost.ms + STEP_COST_SMOOTHING * step_ms,
        keep * cost.tokens + STEP_COST_SMOOTHING * prefill_tokens,
    )


def cap_prefill_for_latency(
    budget: int,
    *,
    latency_budget_ms: float,
    cost: StepCost,
    num_decode_rows: int,
    max_num_batched_tokens: int,
    backlog_tokens: int = 0,
) -> int:
    """The prefill budget of a step with decode rows, cut so the step is expected to take at most
    `latency_budget_ms` (0: no cut); never below max_num_batched_tokens // MIN_PREFILL_SHARE nor below a
    BACKLOG_PREFILL_SHARE-th of the `backlog_tokens` (prompt tokens not yet prefilled, admitted or
    waiting), and unchanged until a step with prefill has been measured. Both bounds come in multiples
    of LATENCY_CUT_GRAIN."""
    per_token = cost.ms_per_token
    if latency_budget_ms <= 0 or num_decode_rows == 0 or per_token is None:
        return budget
    fit = int(latency_budget_ms / per_token) // LATENCY_CUT_GRAIN * LATENCY_CUT_GRAIN
    backlog_share = -(-backlog_tokens // (BACKLOG_PREFILL_SHARE * LATENCY_CUT_GRAIN)) * LATENCY_CUT_GRAIN
    floor = max(max_num_batched_tokens // MIN_PREFILL_SHARE, backlog_share)
    return min(budget, max(fit, floor))


def even_prefill_budget(budget: int, remaining: int, num_decode_rows: int) -> int:
    """The prefill budget of a step whose only prefill work is one prompt with `remaining` tokens left,
    beside `num_decode_rows` decode rows: the prompt's chunks evened out over the fewest steps the
    budget allows, ceil(remaining / budget). Packed greedily, its last step would be a short tail and
    the others full; evened, the longest step of the prompt (the decoders' worst interval) shrinks and
    the step count stays. The step's tokens, prefill and decode rows, round up to a multiple of
    LATENCY_CUT_GRAIN (a prefill graph's token bucket), never past `budget`."""
    if budget <= 0 or remaining <= budget:
        return budget
    steps = -(-remaining // budget)
    even = -(-remaining // steps)
    step_tokens = -(-(even + num_decode_rows) // LATENCY_CUT_GRAIN) * LATENCY_CUT_GRAIN
    return min(budget, step_tokens - num_decode_rows)


def plan_prefill_chunks(remaining: Sequence[int], budget: int, stops: Sequence[int | None] = ()) -> list[int]:
    """Chunk lengths for the prefilling FIFO, packed front to back within the budget. `stops[i]`: the
    tokens request i may take before its next cache point (None: none ahead). A chunk ends at its
    request's cache point (the state must exist at exactly that token) and planning goes on with the
    next request; a chunk the budget cuts is the last one planned."""
    chunks: list[int] = []
    left = budget
    for i, rem in enumerate(remaining):
        if left <= 0:
            break
        stop = stops[i] if i < len(stops) else None
        want = rem if stop is None else min(rem, stop)
        take = min(want, left)
        chunks.append(take)
        left -= take
        if take < want:
            break
    return chunks


def preemptions_needed(free_pages: int, demands: Sequence[tuple[int, int]]) -> int:
    """`demands` lists, oldest first, each page-holding request's (pages held, pages it needs this step).
    Returns how many requests to preempt from the newest end so the rest get their pages: the smallest k
    with sum(need of the first n-k) <= free_pages + sum(held of the last k)."""
    need = sum(n for _, n in demands)
    freed = 0
    k = 0
    while need > free_pages + freed and k < len(demands):
        held, n = demands[len(demands) - 1 - k]
        need -= n
        freed += held
        k += 1
    return k


class PlanKind(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"


def build_next_plan(num_decode_rows: int, num_chunks: int) -> PlanKind | None:
    if num_decode_rows and num_chunks:
        return PlanKind.UNIFIED
    if num_chunks:
        return PlanKind.PREFILL
    if num_decode_rows:
        return PlanKind.DECODE
    return None
