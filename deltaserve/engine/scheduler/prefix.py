"""The scheduler's side of the prefix cache: lookups at admission, cache points, snapshots.

- A request's cache points are where a later request is likely to diverge from it: the positions the
  server names (end of the system message, end of the last user/tool message before the generation
  prompt, where the chat template drops the reasoning of earlier turns) and its prompt's end (which
  a prefill chunk reaches anyway: no extra step; a prompt extending this one resumes there). A prefill
  chunk ends at a cache point and the step saves the state there.
- A request's end (prompt + output, as far as computed) gets a snapshot when it finishes, for
  continuations; its partial last page becomes the snapshot's.
- A request that needs every prompt position scored (prompt logprobs) is never resumed from the cache.
"""

from __future__ import annotations

from deltaserve.cache.manager import CacheWork, PrefixHit
from deltaserve.cache.prefix import extend_page_keys
from deltaserve.engine.scheduler.request import Request, ScheduledChunk
from deltaserve.engine.scheduler.state import SchedulerState

# The prompt-end cache point is left out when a server-named point lies this close before it (a chat
# prompt's generation prompt): a snapshot there would serve nothing the named one does not.
PROMPT_END_MIN_GAP = 16


def cache_points(prompt_len: int, named: list[int]) -> list[int]:
    """The sorted cache points of a prompt: the named positions inside it, and its end."""
    points = sorted({p for p in named if 0 < p < prompt_len})
    if not any(prompt_len - PROMPT_END_MIN_GAP < p for p in points):
        points.append(prompt_len)
    return points


def tokens_to_next_point(req: Request) -> int | None:
    """How many tokens the request's next chunk may take before it reaches a cache point."""
    done = req.num_computed
    for point in req.cache_points:
        if point > done:
            return point - done
    return None


def lookup(sched: SchedulerState, req: Request) -> PrefixHit | None:
    """The longest cached prefix the request can resume from, at least one token short of its end."""
    cache = sched.cache
    if not cache.prefix_caching or _scores_prompt(req):
        return None
    tokens = req.token_slice(0, req.num_tokens)
    extend_page_keys(req.page_keys, tokens, cache.page_size)
    return cache.lookup(req.page_keys, tokens, req.num_tokens - 1)


def save_at_chunk_ends(sched: SchedulerState, chunks: list[ScheduledChunk]) -> CacheWork:
    """Snapshots for the chunks that end on their request's cache point, written after the forward."""
    work = CacheWork()
    if not sched.cache.prefix_caching:
        return work
    for c in chunks:
        end = c.start + c.length
        if end in c.request.cache_points:
            saved = _save(sched, c.request, end, donate=False)
            if saved is not None:
                work.extend(saved)
    return work


def register_computed_pages(sched: SchedulerState, req: Request) -> None:
    """Offers the request's computed full pages (whose tokens are known) to the prefix cache."""
    seq, cache = req.seq, sched.cache
    if seq is None or not cache.prefix_caching:
        return
    known = min(seq.num_computed, req.num_tokens)
    if len(req.page_keys) < known // cache.page_size:
        extend_page_keys(req.page_keys, req.token_slice(0, known), cache.page_size)
    cache.register_pages(seq, req.page_keys, mtp_gaps=req.mtp_gaps)


def save_request_end(sched: SchedulerState, req: Request) -> None:
    """A finishing request's computed tokens are cached: its full pages, and a snapshot of its state
    (written before the next launched forward, before its slot can be reused)."""
    seq = req.seq
    if seq is None or not sched.cache.prefix_caching or seq.num_computed == 0:
        return
    register_computed_pages(sched, req)
    if req.state_ahead:
        return  # its slot holds the state of a later position (speculative decoding): pages only
    saved = _save(sched, req, seq.num_computed, donate=True)
    if saved is not None:
        sched.cache.pending.extend(saved)


def _save(sched: SchedulerState, req: Request, position: int, *, donate: bool) -> CacheWork | None:
    cache = sched.cache
    tokens = req.token_slice(0, position)
    extend_page_keys(req.page_keys, tokens, cache.page_size)
    return cache.save(req.seq, req.page_keys, tokens, position, donate=donate, mtp_gaps=req.mtp_gaps)


def _scores_prompt(req: Request) -> bool:
    return req.prompt_logprobs is not None and not req.prompt_logprobs_sent
