"""A step's rows: what each request puts into the forward (a decode row, a prompt chunk, a verify row
with its drafts), with its pages reserved, and what its sampled position is drawn under (sampling_row:
min_tokens and bad words suppressed, the outputs so far, prompt logprobs to score).
"""

from __future__ import annotations

from deltaserve.engine.penalty_counts import PenaltyReset
from deltaserve.engine.sampler import SamplingRow, uses_penalties
from deltaserve.engine.scheduler.request import Request, ScheduledChunk
from deltaserve.engine.scheduler.spec_plan import SpeculativePlan
from deltaserve.engine.scheduler.state import SchedulerState
from deltaserve.engine.step import PlannedRow, PromptScoring
from deltaserve.sampling_params import SamplingParams


def decode_row(sched: SchedulerState, req: Request, pending: int) -> PlannedRow:
    token = req.output_token_ids[-1] if pending == 0 else 0  # 0: a placeholder for the fed token
    return planned_row(sched, req, [token], sampling_row(sched, req, pending), None)


def chunk_row(sched: SchedulerState, c: ScheduledChunk) -> PlannedRow:
    """A chunk's share of the forward; it samples only when it feeds the request's last pending token."""
    req = c.request
    sampling = sampling_row(sched, req) if c.completes else None
    return planned_row(sched, req, req.token_slice(c.start, c.length), sampling, prompt_scoring(req, c))


def planned_row(
    sched: SchedulerState,
    req: Request,
    tokens: list[int],
    sampling: SamplingRow | None,
    scoring: PromptScoring | None,
    lookahead: int = 0,
) -> PlannedRow:
    """`lookahead`: positions past the row's tokens it also holds pages for (the MTP's proposals)."""
    seq = req.seq
    sched.cache.reserve(seq, seq.num_computed + len(tokens) + lookahead)
    return PlannedRow(tokens, seq.num_computed, seq.pages, seq.slot, sampling, scoring)


def speculative_decode_rows(
    sched: SchedulerState, decode: list[Request], spec: SpeculativePlan
) -> list[PlannedRow]:
    """Plain rows (drafting or not), then verify rows: the last token and `k` proposals, the GDN state
    after each token but the last going to the row's share of the verify scratch slots."""
    scratch = sched.cache.scratch_slots
    per_row = sched.config.speculative.num_speculative_tokens
    rows: list[PlannedRow] = []
    verified = 0
    for req in decode:
        drafts = id(req) in spec.drafting
        k = spec.verify.get(id(req), 0)
        last = req.output_token_ids[-1]
        proposals = (req.draft_tokens + [last] * k)[:k]
        tokens = [last, *proposals]
        row = planned_row(
            sched, req, tokens, sampling_row(sched, req), None, spec.num_drafts - 1 if drafts else 0
        )
        row.drafts = drafts
        req.num_proposed = 0
        if k:
            row.accept_limit = min(k, req.max_tokens - len(req.output_token_ids) - 1)
            req.num_proposed = min(row.accept_limit, len(req.draft_tokens))
            start = scratch.start + verified * per_row
            row.state_after = list(range(start, start + k))
            row.draft_sampling = [sampling_row(sched, req, drafts=proposals[:j]) for j in range(1, k + 1)]
            verified += 1
        rows.append(row)
    return rows


def speculative_chunk_row(sched: SchedulerState, c: ScheduledChunk, spec: SpeculativePlan) -> PlannedRow:
    """A chunk in a speculative step: the MTP head reads the token after its last one (the next prompt
    token, or the sampled one), and a completing chunk proposes drafts when it may."""
    req = c.request
    drafts = spec.chunk_drafts(sched, c)
    sampling = sampling_row(sched, req) if c.completes else None
    row = planned_row(
        sched,
        req,
        req.token_slice(c.start, c.length),
        sampling,
        prompt_scoring(req, c),
        spec.num_drafts - 1 if drafts else 0,
    )
    row.drafts = drafts
    if not c.completes:
        row.mtp_next_token = req.token_slice(c.start + c.length, 1)[0]
    return row


def sampling_row(
    sched: SchedulerState, req: Request, pending: int = 0, drafts: list[int] | None = None
) -> SamplingRow:
    """`pending`: tokens already sampled for the request but not yet on the host (decode-ahead).
    `drafts`: a verify row's proposals before the sampled position, taken as already output."""
    params = req.params
    outputs = req.output_token_ids if not drafts else [*req.output_token_ids, *drafts]
    step = len(outputs) + pending
    suppressed = params.suppressed_ids(step, outputs, sched.config.eos_token_ids)
    row = SamplingRow(params, req.seed, step, req.prompt_token_ids, outputs, suppressed, req.grammar)
    if uses_penalties(params):
        _count_penalties_on_device(sched, req, row, pending, drafts or ())
    return row


def _count_penalties_on_device(
    sched: SchedulerState, req: Request, row: SamplingRow, pending: int, drafts: list[int]
) -> None:
    """The row's penalties read its slot's device counts (engine/penalty_counts.py): written from the
    request's outputs at its first sampled row of this admission, then kept up by each launch."""
    seq = req.seq
    assert seq is not None, "a sampled row's request holds a slot"
    if req.penalties_seq is not seq:
        assert pending == 0, "a request's first sampled row of an admission has no token in flight"
        prompt = req.prompt_token_ids if req.params.repetition_penalty != 1.0 else ()
        sched.penalty_resets.append(PenaltyReset(seq.slot, list(req.output_token_ids), prompt))
        req.penalties_seq = seq
    assert pending <= 1, "one token in flight at most: the row's fed input"
    row.penalty_slot = seq.slot
    row.penalty_extra = drafts
    row.penalty_pending = pending == 1


def needs_output_on_host(params: SamplingParams) -> bool:
    """A bad word of several tokens is matched against the output tokens on the host (penalties count
    them on the device)."""
    return any(len(w) > 1 for w in params.bad_words_token_ids or ())


def prompt_scoring(req: Request, c: ScheduledChunk) -> PromptScoring | None:
    """The chunk's prompt positions that score the next prompt token, when prompt logprobs were asked
    for and not yet sent (a recomputed request scores nothing again)."""
    if req.prompt_logprobs is None or req.prompt_logprobs_sent:
        return None
    prompt = req.prompt_token_ids
    end = min(c.start + c.length, len(prompt) - 1)
    if end <= c.start:
        return None
    assert len(req.prompt_logprobs) == c.start + 1, "prompt logprobs are scored chunk by chunk, in order"
    return PromptScoring(list(prompt[c.start + 1 : end + 1]), req.params.prompt_logprobs)
