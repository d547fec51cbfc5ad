"""Request types and the chunk vocabulary of the scheduler.

Ownership: a request is in exactly one of `compiling` (its grammar compiles off the scheduler thread),
`waiting`, `prefilling`, `inflight` (an async prefill) or `running`, or it has had its single terminal
update (`Phase.DONE`). A step launched ahead holds only
its rows' unread tokens: its decode rows' requests stay in `running`, and its chunks' requests are
requeued (`prefilling`) or promoted (`running`, first token in flight) at launch.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from deltaserve.cache.manager import CacheManager, CacheWork, SequenceCache
from deltaserve.cache.prefix import PageKeys
from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.engine.step import PendingStep, StepResult
from deltaserve.engine.structured import RequestGrammar
from deltaserve.sampling_params import SamplingParams


class Phase(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    INFLIGHT = "inflight"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or the rest of the context window
    seed: int  # sampling seed for the request's whole life
    arrival_time: float
    echo: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    seq: SequenceCache | None = None  # pages + state slot while admitted
    phase: Phase = Phase.WAITING
    closed: bool = False  # the client went away; pruned at the next tick
    admitted_order: int = -1  # admission counter: preemption victims are the newest
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    checked: bool = False  # submission checks (contract, fields, token ids) ran
    admission_checked: bool = False  # passed admission's impossibility checks (they never change for it)
    launched: LaunchedStep | None = None  # the latest step launched over it and not yet waited for
    # Asked-for prompt logprobs so far (entry i scores prompt token i; entry 0 is None), sent with the
    # first token. Invariant while scoring: a prefill chunk starting at s finds s + 1 entries.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    grammar: RequestGrammar | None = None  # structured output, built by the submission checks
    grammar_compile: Future[RequestGrammar] | None = None  # while `compiling`: its grammar's compilation
    # Prefix cache: positions after which a GDN state snapshot is saved (a chunk ends there), sorted;
    # the content keys of its full pages so far; the tokens its first admission found cached.
    cache_points: list[int] = field(default_factory=list)
    page_keys: PageKeys = field(default_factory=PageKeys)  # its root is the request's cache salt's
    num_cached_tokens: int = 0
    # Speculative decoding: the MTP head's proposals for the tokens after the last output token (empty:
    # none, or stale since a step without speculation). `state_ahead`: the request stopped inside an
    # accepted run, so its slot holds the state of a later position than its cursor (no snapshot).
    draft_tokens: list[int] = field(default_factory=list)
    # Of the drafts its latest verify row checked, the proposals it could accept (not padding, not past
    # max_tokens): what the acceptance counters and the guard count.
    num_proposed: int = 0
    state_ahead: bool = False
    # Some position of its sequence lacks the MTP head's own K/V: a step without the MTP pass computed
    # it (speculation configured, the step plain), or it was resumed from prefix-cache pages or a
    # snapshot with such a position. It never drafts again: its drafts would attend to stale K/V, and
    # their low acceptance would steer the guard for every request.
    mtp_gaps: bool = False
    # Penalties: the admission (its cache handle) for which its slot's device counts row was written
    # (engine/penalty_counts.py); any other value: the row belongs to someone else until rewritten.
    penalties_seq: SequenceCache | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed if self.seq is not None else 0

    @property
    def num_pending(self) -> int:
        """Tokens still to feed: the unprefilled prompt (and recomputed outputs), or the last token."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, length: int) -> list[int]:
        prompt = self.prompt_token_ids
        end = start + length
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # position of the chunk's first token (== the request's cursor when scheduled)
    length: int

    @property
    def completes(self) -> bool:
        """The chunk feeds the request's last pending token, so its logits give the next token."""
        return self.start + self.length == self.request.num_tokens


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step launched on the device whose result has not been applied. Its rows are `decode` (one per
    request, first) then `chunks`. A decode-ahead step's requests stay in `running`; an async prefill
    owns its chunks' requests (they are in no queue) until its result is applied. A request that
    retires while the step may still run hands its pages and slot to the step (`deferred`), released
    once the step has been waited for: no KV or state is released under a launched step."""

    decode: list[Request]
    chunks: list[ScheduledChunk]
    pending: PendingStep
    deferred: list[SequenceCache] = field(default_factory=list)
    waited: bool = False
    # Launched ahead: its chunks' requests were requeued or promoted at launch (a promoted request runs
    # with its first token in flight); applying the result only delivers tokens.
    ahead: bool = False
    # An overlapped step's (an async prefill on its own stream) cache work, settled once it has been
    # waited for: its snapshots are not findable, nor the sources of its copies released, while the
    # device may still write or read them beside later steps.
    settle_at_wait: list[CacheWork] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return self.decode + [c.request for c in self.chunks]

    def sampled_requests(self) -> list[Request]:
        """The requests of the step's sampled rows, in row order: every decode row, then the chunks that
        complete."""
        return self.decode + [c.request for c in self.chunks if c.completes]

    def sampled_rows(self) -> dict[int, int]:
        """id(request) -> its row among the step's sampled tokens."""
        return {id(r): i for i, r in enumerate(self.sampled_requests())}

    def wait(self, cache: CacheManager) -> StepResult:
        result = self.pending.wait()
        self.waited = True
        for work in self.settle_at_wait:
            cache.launched(work)
        self.settle_at_wait.clear()
        for seq in self.deferred:
            cache.release(seq)
        self.deferred.clear()
        for r in self.requests:
            if r.launched is self:
                r.launched = None
        return result
