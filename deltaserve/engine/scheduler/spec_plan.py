"""Speculative decoding's plan for one step: the guard's draft count (speculation.py decides it), which
decoders verify their proposals and which draft, within the verify scratch and the free pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.engine.scheduler.request import Request, ScheduledChunk
from deltaserve.engine.scheduler.state import SchedulerState


@dataclass(slots=True)
class SpeculativePlan:
    """A step's speculation: `num_drafts` proposals for each drafting row after the step; the decoders
    that verify (id -> their drafts this step) and that draft; lookahead pages still free for chunks."""

    num_drafts: int
    verify: dict[int, int] = field(default_factory=dict)
    drafting: set[int] = field(default_factory=set)
    free_pages: int = 0

    def chunk_drafts(self, sched: SchedulerState, c: ScheduledChunk) -> bool:
        """A completing chunk drafts when its request may and its lookahead pages are free."""
        req = c.request
        if not c.completes or not may_speculate(req):
            return False
        end = c.start + c.length
        need = sched.cache.pages_needed(req.seq, end + self.num_drafts - 1) - sched.cache.pages_needed(
            req.seq, end
        )
        if need > self.free_pages:
            return False
        self.free_pages -= need
        return True


def may_speculate(req: Request) -> bool:
    """Verify rows sample without a grammar (its state cannot fork per draft); a request drafts only
    while the MTP head's K/V covers its whole sequence (Request.mtp_gaps)."""
    return req.grammar is None and not req.mtp_gaps


def draft_count(sched: SchedulerState, decode: list[Request]) -> int:
    """The drafts per row of a step over `decode`: the guard's count at its size, or 0 (a plain step)
    when no decoder and no prompt being prefilled may take part (no MTP pass for nothing, and the
    step may be launched ahead)."""
    guard = sched.guard
    if guard is None:
        return 0
    k = guard.draft_length(max(1, len(decode)))
    if k and not any(may_speculate(r) for r in (*decode, *sched.prefilling)):
        return 0
    return k


def plan_speculation(sched: SchedulerState, decode: list[Request], free_pages: int) -> SpeculativePlan | None:
    """The guard's draft count for this step and which decoders verify k drafts, while the verify
    scratch lasts and their pages (this step's tokens and the lookahead of the next proposals) are
    free. None: a plain step."""
    k = draft_count(sched, decode)
    if k == 0:
        return None
    cache = sched.cache
    spec = SpeculativePlan(k, free_pages=free_pages)
    max_verify = sched.config.speculative.max_batch
    for req in decode:
        if not may_speculate(req):
            continue
        # Every verify row of a step verifies k drafts (padded when it has fewer proposals: they only
        # cost rejections), so a step of verify rows has one shape; it accepts no more drafts than
        # its request may still emit after the target's token.
        verify = k if len(spec.verify) < max_verify else 0
        base = req.num_computed + 1  # the decode page already ensured
        need = cache.pages_needed(req.seq, base + verify + k - 1) - cache.pages_needed(req.seq, base)
        if need > spec.free_pages:
            continue
        spec.free_pages -= need
        if verify:
            spec.verify[id(req)] = verify
        spec.drafting.add(id(req))
    return spec
