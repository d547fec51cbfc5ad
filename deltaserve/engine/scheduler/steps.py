"""Step drivers: admission, batch prefill, overlap launch, unified prefill+decode, pure decode (with
decode-ahead), and chunk taking (take_prefill_chunks; the chunk vocabulary itself is in request.py).
Token dispatch and retirement (a result's tokens to its requests, chunks promoted or requeued) are in
dispatch.py; what each request puts into a step's forward (its row, pages reserved, and the sampling of
its position) in rows.py; a speculative step's plan (who verifies, who drafts) in spec_plan.py.

Every step is ONE backend forward over a flattened batch: decode rows first, then prefill chunks. A
chunk that reaches the end of its request's tokens samples the request's next token there ("promote");
a partial chunk goes back to the front of the prefilling FIFO ("requeue"). A chunk is partial only
where its request's next cache point lies (the prefix cache saves the state there) or where the token
budget or the free pages cut it, and then it is the step's last.

Launch-ahead (vLLM's async scheduling; `decode_ahead` in the config): a step is launched without
waiting for its tokens (a `LaunchedStep`), its chunks' requests requeued (partial) or promoted to
`running` (complete: the first token in flight) at launch. At the next tick the following step is
planned and launched first: decode rows fed the running step's tokens on the device, prefill chunks
from the prompts' cursors, which moved at launch. Only then are the running step's tokens read and
dispatched, so the host's planning, input building, dispatch and emission overlap the device's step.
A request whose token ends it (a stop token) has had one step too many computed; that step's token is
dropped. A token is dispatched only to a request still running. What needs a token on the host before
the next step can be planned runs synchronously: bad words of several tokens, prompt
logprobs, speculation, an async prefill, the latency budget's timed steps, and preemption (a step short
of pages is planned after the tokens are known). Penalties need no token on the host: they count the
outputs on the device (engine/penalty_counts.py), the token in flight included. A step with grammar
rows launches its forward ahead and its sampler once the tokens before it are dispatched (the masks
need the matchers advanced): the forward still overlaps the host's dispatch.

Speculative decoding (the guard in speculation.py decides k per step): a decoder holding the MTP
head's proposals becomes a verify row (its last token and k drafts, after the plain decode rows), and
every sampling row of the step, completed chunks included, gets new proposals. Such a step is read
at once (no decode-ahead): its cursor advances by the row's tokens at launch and is rewound by the
rejected drafts when the result is applied, after the backend has committed the state of the last
accepted token. Each row also holds pages for the MTP's proposals beyond it (k - 1 positions). Only a
speculative step runs the MTP pass (over every token of the step, which writes the MTP head's K/V):
a request that a plain step advanced (the guard at 0 drafts, an async prefill) drafts no more.
"""

from __future__ import annotations

import time

import torch

from deltaserve.cache.manager import CacheWork, PrefixHit
from deltaserve.engine.scheduler import dispatch, lifecycle, prefix, telemetry
from deltaserve.engine.scheduler.plan import (
    AdmissionCapacity,
    Holding,
    PendingView,
    PlanKind,
    admission_slots,
    admission_window,
    admit_pending_requests,
    build_next_plan,
    cap_prefill_for_latency,
    choose_prefill_budget,
    committed_pages,
    even_prefill_budget,
    is_saturated,
    max_kv_tokens,
    observe_step_cost,
    plan_prefill_chunks,
    preemptions_needed,
    returns_within,
    step_token_budget,
)
from deltaserve.engine.scheduler.request import LaunchedStep, Phase, Request, ScheduledChunk
from deltaserve.engine.scheduler.rows import (
    chunk_row,
    decode_row,
    needs_output_on_host,
    speculative_chunk_row,
    speculative_decode_rows,
)
from deltaserve.engine.scheduler.spec_plan import SpeculativePlan, draft_count, plan_speculation
from deltaserve.engine.scheduler.state import SchedulerState
from deltaserve.engine.step import (
    DeviceSpan,
    StepPlan,
    StepResult,
    TokenFeed,
)

# ---- admission ---------------------------------------------------------------------------------


def admit(sched: SchedulerState) -> None:
    if not sched.waiting:
        return
    cache = sched.cache
    page_size = cache.page_size
    holders = list(sched.prefilling) + (sched.inflight.requests if sched.inflight else [])
    reserve = sched.config.kv_reserve_tokens
    lockstep = sched.config.speculative is None  # every decoder advances one token per step

    def holding(r: Request, decoding: bool) -> Holding:
        lifetime = max_kv_tokens(len(r.prompt_token_ids), r.max_tokens)
        in_step = decoding and lockstep
        returns = in_step and returns_within(r.num_tokens, lifetime, reserve)
        sole = cache.kv.sole_held(r.seq.pages) if returns else 0  # read only where it counts
        return Holding(r.num_tokens, lifetime, len(r.seq.pages), sole, lockstep=in_step)

    holdings = [holding(r, True) for r in sched.running] + [holding(r, False) for r in holders]
    committed = committed_pages(holdings, reserve, page_size)
    capacity = AdmissionCapacity(
        max_model_len=sched.config.max_model_len,
        page_size=page_size,
        capacity_pages=cache.kv.capacity,
        free_pages=cache.kv.num_free,
        committed_pages=committed,
        free_slots=cache.states.num_free,
        num_active=len(sched.running) + len(holders),
        max_num_seqs=sched.config.max_num_seqs,
        reserve_tokens=reserve,
    )
    queue = list(sched.waiting)
    window = admission_window([r.admission_checked for r in queue], admission_slots(capacity))
    waiting = [queue[i] for i in window]
    views = [PendingView(len(r.prompt_token_ids), r.max_tokens, len(r.output_token_ids)) for r in waiting]
    hits: dict[int, PrefixHit | None] = {}

    def cached_pages(index: int) -> int:
        hits[index] = hit = prefix.lookup(sched, waiting[index])
        return 0 if hit is None else sum(1 for page in hit.pages if cache.kv.refs(page) > 0)

    decision = admit_pending_requests(views, capacity, cached_pages)
    gone = set(decision.admitted)
    for index, rejection in decision.rejected:
        gone.add(index)
        lifecycle.send_rejection(sched, waiting[index], rejection.message, "max_tokens")
    for index in decision.admitted:
        req = waiting[index]
        hit = hits.get(index)
        req.seq = cache.open() if hit is None else cache.open_hit(hit)
        req.mtp_gaps = hit is not None and hit.mtp_gaps  # a preempted request computes again
        if cache.prefix_caching and req.num_preemptions == 0:  # counted at its first admission
            req.num_cached_tokens = 0 if hit is None else hit.position
            sched.prefix_queries += req.num_tokens
            sched.prefix_hits += req.num_cached_tokens
        req.phase = Phase.PREFILLING
        if req.first_scheduled_time is None:  # the end of its queue time: this tick plans its first chunk
            req.first_scheduled_time = time.monotonic()
        req.admitted_order = sched._admitted
        sched._admitted += 1
        sched.prefilling.append(req)
    for i, req in enumerate(waiting):  # every request of the window went through the checks
        if i not in gone:
            req.admission_checked = True
    if gone:
        taken = {id(waiting[i]) for i in gone}
        sched.waiting = type(sched.waiting)(r for r in queue if id(r) not in taken)


# ---- one step ----------------------------------------------------------------------------------


def run_step(sched: SchedulerState) -> None:
    """One step: with a step launched ahead, launch the one after it when it can be planned without
    its tokens, then read it; otherwise (or after reading it) plan decode rows and prefill chunks and
    launch them as one plan.

    The step log's line describes the step whose tokens the tick delivered (the end of a decoder's
    inter-token interval), or, in a tick that only launched, the step it launched."""
    started = time.monotonic() if telemetry.ITL_DEBUG else 0.0
    ahead = sched.decode_ahead
    if ahead is not None:
        follow = _launch_following(sched, ahead)  # `ahead` stays owned until read: a fatal launch drains it
        sched.decode_ahead = follow
        finish_decode_ahead(sched, ahead)
        if follow is not None:
            _sample_after_dispatch(follow)
            if telemetry.ITL_DEBUG:
                _log_delivered_ahead(ahead, started)
            return
    decode, chunks, spec = _plan_work(sched)
    label = _launch_work(sched, decode, chunks, spec)
    if telemetry.ITL_DEBUG:
        # A tick that delivered `ahead` and then launched ahead, or nothing, describes `ahead`.
        if ahead is not None and (label.endswith("_ahead") or label == "idle"):
            _log_delivered_ahead(ahead, started)
        else:
            _log_step(label, decode, chunks, started)


def _log_delivered_ahead(ahead: LaunchedStep, started: float) -> None:
    kind = build_next_plan(len(ahead.decode), len(ahead.chunks))
    assert kind is not None, "a launched step has rows"
    _log_step(f"{kind.value}_ahead", ahead.decode, ahead.chunks, started, ahead.pending.device_span)


def _log_step(
    label: str,
    decode: list[Request],
    chunks: list[ScheduledChunk],
    started: float,
    span: DeviceSpan | None = None,
) -> None:
    prefill_tokens = sum(c.length for c in chunks)
    telemetry.log_itl_step(label, prefill_tokens, len(chunks), len(decode), started, time.monotonic(), span)


def _plan_work(
    sched: SchedulerState,
) -> tuple[list[Request], list[ScheduledChunk], SpeculativePlan | None]:
    """This step's decode rows (every running request, with its next page ensured, preempting the
    newest page holders when the pool cannot), its speculation, and prefill chunks (within the budget
    and free pages; a lone prompt beside decoders, with nothing queued behind it, in even chunks)."""
    decode_pages = _ensure_decode_pages(sched)
    decode = list(sched.running)
    spec = plan_speculation(sched, decode, sched.cache.kv.num_free - decode_pages)
    if spec is not None:
        decode_pages = sched.cache.kv.num_free - spec.free_pages
    if sched.inflight is not None or not sched.prefilling:
        return decode, [], spec
    chunks = take_prefill_chunks(
        sched, _prefill_budget(sched, decode), sched.cache.kv.num_free - decode_pages
    )
    if spec is not None:
        spec.free_pages = sched.cache.kv.num_free - decode_pages - _chunk_pages(sched, chunks)
        if chunks:
            # Beside prompt chunks the decoders draft but verify nothing: a step with verify rows runs
            # eager (no prefill graph holds them), which costs a chunk step more than its drafts save.
            spec.verify.clear()
    return decode, chunks, spec


def _prefill_budget(sched: SchedulerState, decode: list[Request], pending: int = 0) -> int:
    """This step's prefill tokens beside `decode` (`pending`: tokens each decoder has in flight)."""
    config = sched.config
    sched.saturated = is_saturated(
        was_saturated=sched.saturated,
        num_waiting=len(sched.waiting),
        num_prefilling=len(sched.prefilling),
        max_num_seqs=config.max_num_seqs,
    )
    step_tokens = step_token_budget(
        config.max_num_batched_tokens, config.max_num_batched_tokens_saturated, saturated=sched.saturated
    )
    budget = choose_prefill_budget(
        policy=config.policy,
        max_num_batched_tokens=step_tokens,
        num_decode_rows=len(decode),
        decode_tokens_left=[r.max_tokens - len(r.output_token_ids) - pending for r in decode],
        front_remaining=sched.prefilling[0].num_pending,
    )
    if decode and len(sched.prefilling) == 1 and not sched.waiting:
        budget = even_prefill_budget(budget, sched.prefilling[0].num_pending, len(decode))
    return cap_prefill_for_latency(
        budget,
        latency_budget_ms=config.decode_latency_budget_ms,
        cost=sched.step_cost,
        num_decode_rows=len(decode),
        max_num_batched_tokens=step_tokens,
        backlog_tokens=_prefill_backlog(sched) if config.decode_latency_budget_ms > 0 and decode else 0,
    )


def _prefill_backlog(sched: SchedulerState) -> int:
    """Tokens still to prefill: the admitted prompts' pending tokens and the waiting requests' tokens."""
    return sum(r.num_pending for r in sched.prefilling) + sum(r.num_tokens for r in sched.waiting)


def _chunk_pages(sched: SchedulerState, chunks: list[ScheduledChunk]) -> int:
    return sum(sched.cache.pages_needed(c.request.seq, c.start + c.length) for c in chunks)


def _launch_work(
    sched: SchedulerState,
    decode: list[Request],
    chunks: list[ScheduledChunk],
    spec: SpeculativePlan | None = None,
) -> str:
    """Launches the planned work and returns its telemetry label. Every forward covers decode rows then
    chunks; how its result is read depends on the mode: now (synchronous), at the next tick (decode-
    ahead), or when an async prefill finishes (overlap)."""
    kind = build_next_plan(len(decode), len(chunks))
    if kind is None:
        if sched.inflight is not None:
            finish_async_prefill(sched)  # nothing to decode: wait for the prefill instead of parking
            return "overlap_wait"
        if sched.prefilling:
            _relieve_page_deadlock(sched)
        return "idle"
    if sched.config.prefill_overlap and kind is PlanKind.UNIFIED:
        launch_overlap_step(sched, chunks)
        _run_now(sched, decode, [], spec)
        return "overlap_launch"
    if spec is None and sched.inflight is None and _may_launch_ahead(sched, decode, chunks):
        sched.decode_ahead = _launch_ahead(sched, decode, chunks)
        return f"{kind.value}_ahead"
    _run_now(sched, decode, chunks, spec)
    return "overlap_decode" if sched.inflight is not None else kind.value


def _launch(
    sched: SchedulerState,
    decode: list[Request],
    chunks: list[ScheduledChunk],
    feed: TokenFeed | None = None,
    spec: SpeculativePlan | None = None,
    overlapped: bool = False,
) -> LaunchedStep | None:
    """Builds the step's plan (reserving each row's pages through the cache manager), launches it and
    advances every row's cursor: after this, KV, conv/SSM state and position have moved together by the
    row's tokens. The plan also carries the prefix cache's pending copies (before the forward) and the
    snapshots of chunks ending on a cache point (after it), settled at launch, or once the step has
    been waited for when it is `overlapped` (an async prefill, which runs beside later steps).
    Returns None when the launch ran out of memory (its requests have failed)."""
    cache = sched.cache
    pending = 0 if feed is None else 1  # a fed row's input token is in flight, not yet on the host
    if sched.guard is not None and spec is None:
        # A plain step runs no MTP pass over its positions (before the snapshots below are planned).
        for req in decode + [c.request for c in chunks]:
            req.mtp_gaps = True
    if spec is not None:  # plain decode rows first, then verify rows
        decode = [r for r in decode if id(r) not in spec.verify] + [r for r in decode if id(r) in spec.verify]
    before, after = cache.take_pending(), CacheWork()
    try:
        if spec is None:
            decode_rows = [decode_row(sched, r, pending) for r in decode]
            chunk_rows = [chunk_row(sched, c) for c in chunks]
        else:
            decode_rows = speculative_decode_rows(sched, decode, spec)
            chunk_rows = [speculative_chunk_row(sched, c, spec) for c in chunks]
        plan = StepPlan(
            decode=decode_rows,
            prefill=chunk_rows,
            feed=feed,
            num_drafts=0 if spec is None else spec.num_drafts,
            force_accept=spec is not None and _forced_acceptance(sched),
        )
        after = prefix.save_at_chunk_ends(sched, chunks)  # after every row's pages are reserved
        plan.copies_before, plan.copies_after = before.copies, after.copies
        # Taken last, so that a plan that fails before its launch leaves them for the next one. An
        # overlapped step runs on its own stream: it rewrites only its own rows' penalty counts, and the
        # outputs seen since the last launch wait for the next step on the main stream.
        plan.penalty_tokens, plan.penalty_resets = sched.take_penalty_work(tokens=not overlapped)
        if telemetry.ITL_DEBUG:
            telemetry.mark("plan")
        launched = sched.backend.launch(plan, overlapped=True) if overlapped else sched.backend.launch(plan)
        if telemetry.ITL_DEBUG:
            telemetry.mark("launch")
            telemetry.note_launch(launched)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        cache.pending.extend(before)  # not known to have run: they run again with the next launch
        cache.abandoned(after)
        lifecycle.fail_requests(
            sched, decode + [c.request for c in chunks], f"step failed: out of memory ({exc})"
        )
        return None
    step = LaunchedStep(decode, chunks, launched)
    if overlapped:
        step.settle_at_wait += [before, after]
    else:
        cache.launched(before)
        cache.launched(after)
    if sched.guard is not None and decode:
        sched.guard.record_step(drafted=spec is not None)
    for req, row in zip(step.requests, plan.rows, strict=True):
        cache.advance(req.seq, len(row.token_ids))
        req.launched = step
    return step


def flush_cache_copies(sched: SchedulerState) -> None:
    """Launches the prefix cache's pending copies that no step carried this tick (end-of-request
    snapshots become findable for the next admission)."""
    cache = sched.cache
    if cache.pending.copies:
        work = cache.take_pending()
        sched.backend.launch(StepPlan(copies_before=work.copies))
        cache.launched(work)


def _run_now(
    sched: SchedulerState,
    decode: list[Request],
    chunks: list[ScheduledChunk],
    spec: SpeculativePlan | None = None,
) -> None:
    """Pure decode, batch prefill or unified prefill+decode, read at once. A unified step's duration
    feeds the latency budget's cost estimate when the budget is on."""
    timed = sched.config.decode_latency_budget_ms > 0 and decode and chunks
    started = time.monotonic() if timed else 0.0
    step = _launch(sched, decode, chunks, spec=spec)
    if step is None:
        return
    result = _wait(sched, step)
    if timed:
        elapsed_ms = (time.monotonic() - started) * 1e3
        sched.step_cost = observe_step_cost(sched.step_cost, elapsed_ms, sum(c.length for c in chunks))
    _apply(sched, step, result)


def _wait(sched: SchedulerState, step: LaunchedStep) -> StepResult:
    result = step.wait(sched.cache)
    if telemetry.ITL_DEBUG:
        telemetry.mark("wait")
    return result


def _apply(sched: SchedulerState, step: LaunchedStep, result: StepResult) -> None:
    apply_step(sched, step, result)
    if telemetry.ITL_DEBUG:
        telemetry.mark("apply")


def apply_step(sched: SchedulerState, step: LaunchedStep, result: StepResult) -> None:
    """A step's result: tokens to its decode rows' requests still running, then its chunks promoted or
    requeued (a step launched ahead handed them over at launch: its completed chunks' requests still
    running get their first token)."""
    dispatch.dispatch_decode_tokens(sched, step.decode, result)
    if step.ahead:
        dispatch.deliver_first_tokens(sched, step.chunks, result, offset=len(step.decode))
    else:
        dispatch.promote_or_requeue(sched, step.chunks, result, offset=len(step.decode))
    cache = sched.cache
    if cache.prefix_caching:
        size = cache.page_size
        for req in step.requests:
            seq = req.seq
            if seq is not None and seq.num_computed // size > seq.registered and req.phase is not Phase.DONE:
                prefix.register_computed_pages(sched, req)


def _may_decode_ahead(sched: SchedulerState, decode: list[Request]) -> bool:
    """Launching ahead needs no host knowledge of the token in flight, but for a bad word of several
    tokens, which is matched against the output tokens: a step with such a row runs synchronously.
    (Penalties count the token in flight on the device; a grammar row's step launches its forward
    ahead and samples once the token before it is dispatched: `_sample_after_dispatch`.)"""
    return sched.config.decode_ahead and not any(needs_output_on_host(r.params) for r in decode)


def _may_launch_ahead(sched: SchedulerState, decode: list[Request], chunks: list[ScheduledChunk]) -> bool:
    """A planned step goes ahead when its decoders may (`_may_decode_ahead`) and its chunks too: not
    beside an async prefill's mode, not timed for the latency budget, no prompt logprobs to read at
    once, and requests that may decode ahead once promoted."""
    if not _may_decode_ahead(sched, decode):
        return False
    if not chunks:
        return bool(decode)
    config = sched.config
    if config.prefill_overlap or (decode and config.decode_latency_budget_ms > 0):
        return False
    requests = [c.request for c in chunks]
    scoring = any(r.prompt_logprobs is not None and not r.prompt_logprobs_sent for r in requests)
    return _may_decode_ahead(sched, requests) and not scoring


def _launch_ahead(
    sched: SchedulerState, decode: list[Request], chunks: list[ScheduledChunk], feed: TokenFeed | None = None
) -> LaunchedStep | None:
    """Launches the step without reading it, and hands its chunks' requests over at once: a partial
    chunk's request back to the front of the prefilling FIFO (its cursor has moved), a completing
    chunk's to the decoders, its first token in flight."""
    step = _launch(sched, decode, chunks, feed)
    if step is None:
        return None
    step.ahead = True
    requeue: list[Request] = []
    for c in chunks:
        req = c.request
        if c.completes:
            req.phase = Phase.RUNNING
            sched.running.append(req)
        else:
            req.phase = Phase.PREFILLING
            requeue.append(req)
    sched.prefilling.extendleft(reversed(requeue))
    return step


def _launch_following(sched: SchedulerState, ahead: LaunchedStep) -> LaunchedStep | None:
    """The step after `ahead`, launched ahead before `ahead` is read: every decoder (each has its
    token in flight in `ahead`, fed on the device) but those whose token in flight is their last, and
    the next prefill chunks, within the free pages. None when it cannot be planned without the tokens
    (an async prefill, speculation, a row or chunk that must run synchronously, too few free pages:
    preemption is planned after the tokens are known) or there is nothing to launch; the caller then
    reads `ahead` and plans normally."""
    if sched.inflight is not None:
        return None
    fed = ahead.sampled_rows()
    if any(id(r) not in fed for r in sched.running):
        return None
    follow = [r for r in sched.running if len(r.output_token_ids) + 1 < r.max_tokens]
    if not _may_decode_ahead(sched, follow):
        return None
    if draft_count(sched, follow) > 0:
        return None  # the next step speculates: it is planned once these tokens are known
    cache = sched.cache
    free = cache.kv.num_free - sum(cache.pages_needed(r.seq, r.num_computed + 1) for r in follow)
    if free < 0:
        return None
    chunks: list[ScheduledChunk] = []
    if sched.prefilling:
        if sched.config.prefill_overlap:
            return None  # the overlap mode plans its chunks synchronously
        chunks = take_prefill_chunks(sched, _prefill_budget(sched, follow, pending=1), free)
        if not _may_launch_ahead(sched, follow, chunks):
            sched.prefilling.extendleft(reversed([c.request for c in chunks]))  # taken back, untouched
            return None
    if not follow and not chunks:
        return None
    feed = TokenFeed(ahead.pending, [fed[id(r)] for r in follow]) if follow else None
    return _launch_ahead(sched, follow, chunks, feed)


def _sample_after_dispatch(step: LaunchedStep) -> None:
    """Samples a step launched ahead whose grammar rows waited for the tokens before them (dispatched
    now: their matchers have accepted them). A row whose request has ended since gets no mask: its
    matcher may have terminated, and its token is dropped."""
    if not step.pending.awaits_sampling:
        return
    for req, row in zip(step.sampled_requests(), step.pending.rows, strict=True):
        if req.phase is Phase.DONE:
            row.grammar = None
    step.pending.sample()


def finish_decode_ahead(sched: SchedulerState, ahead: LaunchedStep) -> None:
    """Reads the step's tokens and dispatches them to its requests that are still running."""
    _apply(sched, ahead, _wait(sched, ahead))


def launch_overlap_step(sched: SchedulerState, chunks: list[ScheduledChunk]) -> None:
    """Launches the chunks asynchronously; the loop keeps decoding and finishes them at a later tick.
    At most one is in flight, and no prefill is planned while it is."""
    assert sched.inflight is None, "one async prefill at a time"
    for c in chunks:
        c.request.phase = Phase.INFLIGHT
    sched.inflight = _launch(sched, [], chunks, overlapped=True)


def finish_async_prefill(sched: SchedulerState) -> None:
    """Waits for the in-flight prefill (if any) and promotes or requeues its requests."""
    inflight = sched.inflight
    if inflight is None:
        return
    sched.inflight = None
    apply_step(sched, inflight, inflight.wait(sched.cache))


# ---- chunk vocabulary --------------------------------------------------------------------------


def take_prefill_chunks(sched: SchedulerState, budget: int, free_pages: int) -> list[ScheduledChunk]:
    """Takes chunks off the front of the prefilling FIFO within the token budget and the free pages;
    the requests leave the FIFO (promote_or_requeue puts unfinished ones back at its front)."""
    page_size = sched.cache.page_size
    queue = list(sched.prefilling)
    lengths = plan_prefill_chunks(
        [r.num_pending for r in queue], budget, [prefix.tokens_to_next_point(r) for r in queue]
    )
    chunks: list[ScheduledChunk] = []
    for req, planned in zip(queue, lengths, strict=False):
        fits = (len(req.seq.pages) + free_pages) * page_size - req.num_computed
        length = min(planned, fits)
        if length <= 0:
            break
        free_pages -= sched.cache.pages_needed(req.seq, req.num_computed + length)
        chunks.append(ScheduledChunk(req, req.num_computed, length))
        if length < planned:
            break  # out of pages: no chunk after it
    for _ in chunks:
        sched.prefilling.popleft()
    return chunks


def _forced_acceptance(sched: SchedulerState) -> bool:
    source = sched.benchmark_drafts
    return source is not None and source.forces_acceptance


# ---- preemption ----------------------------------------------------------------------------------


def _ensure_decode_pages(sched: SchedulerState) -> int:
    """Makes sure every decoder can write its next position, preempting the newest page holders when
    the pool cannot; returns the pages the decode rows will take this step."""
    cache = sched.cache
    need = sum(cache.pages_needed(r.seq, r.num_computed + 1) for r in sched.running)
    if need <= cache.kv.num_free:
        return need
    holders = sorted(list(sched.running) + list(sched.prefilling), key=lambda r: r.admitted_order)
    running = set(map(id, sched.running))
    # What preempting a holder gives back: its pages no other sequence shares.
    demands = [
        (
            cache.pages_freed_by_release(r.seq),
            cache.pages_needed(r.seq, r.num_computed + 1) if id(r) in running else 0,
        )
        for r in holders
    ]
    victims = preemptions_needed(cache.kv.num_free, demands)
    for req in reversed(holders[len(holders) - victims :]):
        preempt(sched, req)
    return sum(cache.pages_needed(r.seq, r.num_computed + 1) for r in sched.running)


def preempt(sched: SchedulerState, req: Request) -> None:
    """Recompute preemption: frees the request's pages and state slot; it goes back to the front of the
    waiting queue and later recomputes prompt + outputs (the state transaction restarts at zero)."""

    lifecycle.release_caches(sched, req)
    req.draft_tokens.clear()
    req.phase = Phase.WAITING
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        req.prompt_logprobs = [None]  # the recomputed prefill scores the prompt again from its start
    req.num_preemptions += 1
    sched.num_preemptions += 1
    sched.running = [r for r in sched.running if r is not req]
    if req in sched.prefilling:
        sched.prefilling.remove(req)
    sched.waiting.appendleft(req)


def _relieve_page_deadlock(sched: SchedulerState) -> None:
    """No decoders, nothing in flight, and the prefilling FIFO could not get a page: the newest
    prefilling request gives its pages back so the older ones proceed (recomputed later)."""
    holders = sorted(sched.prefilling, key=lambda r: r.admitted_order)
    if len(holders) > 1 and sched.cache.pages_freed_by_release(holders[-1].seq):
        preempt(sched, holders[-1])
        return
    raise RuntimeError(
        f"prefill cannot progress: {sched.cache.kv.num_free} free KV pages for a chunk of request "
        f"{holders[0].request_id} ({holders[0].num_pending} tokens pending)"
    )
