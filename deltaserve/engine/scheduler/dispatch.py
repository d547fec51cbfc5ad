"""Token dispatch: a step's result to its requests. Decode rows' tokens to the requests still running
(a speculative step's accepted runs, its cursor rewound over the rejected drafts), and chunks promoted
(their first token; the request joins the decoders or finishes) or requeued. Every token goes out as an
update; a request that stops (EOS, a stop id, its length, its grammar) retires here.
"""

from __future__ import annotations

from deltaserve.engine.protocol import RequestUpdate, TokenLogprobs
from deltaserve.engine.scheduler import lifecycle
from deltaserve.engine.scheduler.request import Phase, Request, ScheduledChunk
from deltaserve.engine.scheduler.state import SchedulerState
from deltaserve.engine.step import SpeculationResult, StepResult


def promote_or_requeue(
    sched: SchedulerState, chunks: list[ScheduledChunk], result: StepResult, offset: int
) -> None:
    """After a prefill forward: a completed chunk's request gets its sampled token and joins the decoders
    (or finishes); a partial chunk's request returns to the FRONT of the prefilling FIFO."""

    sampled = offset
    requeue: list[Request] = []
    for i, c in enumerate(chunks):
        req = c.request
        scored = result.prompt_logprobs[offset + i] if result.prompt_logprobs else None
        if scored is not None and req.prompt_logprobs is not None:
            req.prompt_logprobs.extend(scored)
        if req.closed:
            if c.completes:
                sampled += 1
            lifecycle.retire(sched, req, finish_reason="abort")
            continue
        if not c.completes:
            req.phase = Phase.PREFILLING
            requeue.append(req)
            continue
        token, logprobs = result.token_ids[sampled], result.logprobs[sampled]
        if result.speculation is not None:
            _keep_proposals(sched, req, result.speculation.drafts[sampled], 1)
        sampled += 1
        if not _append_token(sched, req, token, logprobs):
            req.phase = Phase.RUNNING
            sched.running.append(req)
    sched.prefilling.extendleft(reversed(requeue))


def deliver_first_tokens(
    sched: SchedulerState, chunks: list[ScheduledChunk], result: StepResult, offset: int
) -> None:
    """The first tokens of a launched-ahead step's completed chunks, to their requests still running
    (promoted at launch; one that left since, aborted or failed, gets nothing)."""
    finished = []
    sampled = offset
    for c in chunks:
        if not c.completes:
            continue
        req, row = c.request, sampled
        sampled += 1
        if req.phase is Phase.RUNNING and _append_token(
            sched, req, result.token_ids[row], result.logprobs[row]
        ):
            finished.append(req)
    _leave_running(sched, finished)


def dispatch_decode_tokens(sched: SchedulerState, decode: list[Request], result: StepResult) -> None:
    """Row i's token goes to decode[i] if it is still running (not aborted, failed or retired since the
    step was launched)."""

    finished = []
    spec = result.speculation
    for i, req in enumerate(decode):
        if req.phase is not Phase.RUNNING:
            continue
        if spec is not None:
            done = _append_speculated(sched, req, spec, i)
        else:
            req.draft_tokens.clear()  # proposals for positions this step has moved past
            done = _append_token(sched, req, result.token_ids[i], result.logprobs[i])
        if done:
            finished.append(req)
    _leave_running(sched, finished)


def _append_speculated(sched: SchedulerState, req: Request, spec: SpeculationResult, row: int) -> bool:
    """A speculative step's tokens for one decode row: the cursor steps back over the rejected drafts
    (the backend committed the state of the last accepted token), then the emitted tokens go out one
    by one as a plain decode would have emitted them; the row's new proposals are kept. True if the
    request finished."""
    emitted, drafted = spec.emitted[row], spec.num_drafted[row]
    seq = req.seq
    sched.cache.rewind(seq, drafted + 1 - len(emitted))
    proposed = min(req.num_proposed, drafted)  # the rest were padding, not the MTP head's proposals
    if proposed:
        accepted = min(len(emitted) - 1, proposed)
        sched.spec_counters.record(proposed, accepted)
        if sched.guard is not None:
            sched.guard.record_verify(proposed, accepted)
    _keep_proposals(sched, req, spec.drafts[row], len(emitted))
    end = seq.num_computed
    for j, token in enumerate(emitted):
        # While token j goes out the request has computed what a plain decode would have: up to the
        # token before it. Before the last one, its slot holds a later state.
        seq.num_computed = end - len(emitted) + j + 1
        req.state_ahead = j < len(emitted) - 1
        if _append_token(sched, req, token, spec.logprobs[row][j]):
            return True
    return False


def _keep_proposals(sched: SchedulerState, req: Request, proposals: list[int], emitting: int) -> None:
    """The MTP head's proposals for the tokens after the `emitting` ones about to be appended (or the
    benchmark-only source's)."""
    source = sched.benchmark_drafts
    if source is not None and proposals:
        proposals = source.proposals(req.prompt_token_ids, len(req.output_token_ids) + emitting, proposals)
    req.draft_tokens = list(proposals)


def _append_token(sched: SchedulerState, req: Request, token: int, logprobs: TokenLogprobs | None) -> bool:
    """Appends a sampled token, emits it, and retires the request if it stopped. True if it finished."""
    req.output_token_ids.append(token)
    if req.seq is not None and req.penalties_seq is req.seq:  # its slot's device counts (rows.py)
        sched.penalty_tokens.append((req.seq.slot, token))
    if req.grammar is not None and not req.grammar.accept(token):
        lifecycle.retire(
            sched,
            req,
            update=RequestUpdate(
                req.request_id, finish_reason="error", error=f"token {token} broke the structured output"
            ),
        )
        return True
    reason, stop_reason = _check_stop(sched, req, token)
    if reason is None and req.grammar is not None and req.grammar.finished:
        reason = "stop"
    update = RequestUpdate(
        req.request_id,
        [token],
        [logprobs] if logprobs is not None else None,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_output_tokens=len(req.output_token_ids),
        num_preemptions=req.num_preemptions,
        num_cached_tokens=req.num_cached_tokens,
    )
    if len(req.output_token_ids) == 1 and req.first_scheduled_time is not None:
        update.queued_time = req.first_scheduled_time - req.arrival_time
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        update.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
    if reason is None:
        sched.updates.append(update)
        return False
    update.finish_reason, update.stop_reason = reason, stop_reason
    lifecycle.retire(sched, req, update=update)
    return True


def _check_stop(sched: SchedulerState, req: Request, token: int) -> tuple[str | None, int | None]:
    params = req.params
    produced = len(req.output_token_ids)
    if produced >= params.min_tokens:
        if not params.ignore_eos and token in sched.config.eos_token_ids:
            return "stop", None
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop", token
    if produced >= req.max_tokens:
        return "length", None
    return None, None


def _leave_running(sched: SchedulerState, finished: list[Request]) -> None:
    """Takes the requests that finished in a dispatch out of the decoders."""
    if finished:
        done = set(map(id, finished))
        sched.running = [r for r in sched.running if id(r) not in done]
