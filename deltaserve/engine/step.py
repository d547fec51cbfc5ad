"""The step vocabulary between the scheduler and the backend.

A tick builds ONE `StepPlan`: decode rows (one token each, or under speculative decoding a verify row:
the last token and its drafts) first, then prefill chunks, each naming the pages, state slot and context
the cache manager gave it, plus an optional token feed and the prefix cache's device copies (hits
restored, snapshots saved). The backend
executes the plan without allocating anything and returns a `PendingStep`; the scheduler advances the
cursors at launch and applies the `StepResult` when it reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deltaserve.cache.copies import CacheCopy
from deltaserve.engine.penalty_counts import PenaltyReset
from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.engine.sampler import Sampler, SamplingRow
from deltaserve.engine.structured import apply_grammars
from deltaserve.ops.batch import BatchRow
from deltaserve.ops.pinned import PINNED


@dataclass(frozen=True, slots=True)
class DeviceSpan:
    """Timing events around one launch's device work on its stream (the step log's device and idle
    times, with DELTASERVE_ITL_DEBUG): `start` is reached when the stream starts the launch's first
    kernel, `end` once its results' copy to the host is done (a step whose sampling waits for a grammar's
    mask: once its forward is); `previous_end` is the end of the launch before it on the same stream
    (None for the first)."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    previous_end: torch.cuda.Event | None = None

    @staticmethod
    def mark() -> torch.cuda.Event:
        """A timing event recorded on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @property
    def done(self) -> bool:
        return self.end.query()

    def device_ms(self) -> float:
        """The launch's time on the device, from its first kernel's start to its end (once done)."""
        return self.start.elapsed_time(self.end)

    def idle_ms(self) -> float | None:
        """How long the stream waited for this launch after the one before it ended (once done): about 0
        when it was queued in time; None for the stream's first."""
        return None if self.previous_end is None else self.previous_end.elapsed_time(self.start)


@dataclass(slots=True)
class PromptScoring:
    """Prompt logprobs for a row: the distribution after its token i scores `targets[i]` (the next
    prompt token), for the first len(targets) tokens of the row, with the `k` most likely tokens."""

    targets: list[int]
    k: int


@dataclass(slots=True)
class PlannedRow:
    """One sequence's share of a step: `token_ids` continue a sequence that holds `context_len`
    positions; `pages` (valid at launch) cover context_len + len(token_ids) positions."""

    token_ids: Sequence[int]
    context_len: int
    pages: Sequence[int]
    slot: int
    sampling: SamplingRow | None = None  # set: sample a token from the row's last position
    scoring: PromptScoring | None = None
    # Speculative decoding. A verify row's token_ids are its last token then its drafts: `state_after`
    # names the scratch slots that receive the GDN state after each token but the last, `sampling`
    # samples after its first token and `draft_sampling` after each draft (step + 1, ...).
    state_after: Sequence[int] = ()
    draft_sampling: Sequence[SamplingRow] = ()
    drafts: bool = False  # the MTP head proposes the row's next tokens after this step
    # A verify row accepts at most this many drafts (one fewer than the tokens its request may still
    # emit), so it never computes past its request's end; None: all of them.
    accept_limit: int | None = None
    # The MTP head's input after the row's last token when the row does not sample (a chunk inside the
    # prompt: the next prompt token).
    mtp_next_token: int | None = None

    @property
    def is_verify(self) -> bool:
        return bool(self.state_after)

    @property
    def sampling_rows(self) -> list[SamplingRow]:
        """What the row samples, in position order: one row, or a verify row's 1 + drafts."""
        return [] if self.sampling is None else [self.sampling, *self.draft_sampling]

    def batch_row(self) -> BatchRow:
        scored = len(self.scoring.targets) if self.scoring is not None else 0
        return BatchRow(
            self.token_ids,
            self.context_len,
            self.pages,
            self.slot,
            self.sampling is not None,
            scored,
            state_after=self.state_after,
        )


class PendingStep:
    """A launched step whose result is read later. `token_ids` holds the sampled tokens on the device
    (what a later step's TokenFeed reads); `wait()` returns the host copy.

    A step whose sampling is deferred (`sample_later`) has launched its forward only: its rows' grammar
    masks need the tokens in flight before it on the host. `sample()` launches the sampler once they
    are dispatched (the matchers advanced); until then it has no `token_ids`, and waiting samples it
    first."""

    def __init__(
        self,
        token_ids: torch.Tensor | None,
        staged: StagedResult | None,
        rows: Sequence[SamplingRow],
        prompt_logprobs: list[list[TokenLogprobs] | None] | None = None,
        sample_later: Callable[[], tuple[torch.Tensor, StagedResult]] | None = None,
    ) -> None:
        self.token_ids = token_ids  # [sampled rows] int64 on the device; None when nothing samples
        self._staged = staged
        self._rows = rows
        self._prompt_logprobs = prompt_logprobs or []
        self._result: StepResult | None = None
        self._sample_later = sample_later
        # An overlapped step's (engine/backend.py): recorded after all of its device work, the pages and
        # state it writes included; it is not ready, nor read, before that.
        self.finished: torch.cuda.Event | None = None
        self.device_span: DeviceSpan | None = None  # with step timing on (engine/backend.py)

    @property
    def rows(self) -> Sequence[SamplingRow]:
        """What the step samples, in row order."""
        return self._rows

    @property
    def awaits_sampling(self) -> bool:
        return self._sample_later is not None

    def sample(self) -> None:
        """Launches the deferred sampling (no-op when there is none left)."""
        if self._sample_later is not None:
            sample, self._sample_later = self._sample_later, None
            self.token_ids, self._staged = sample()

    @classmethod
    def done(cls, result: StepResult) -> PendingStep:
        """A step whose result was read during its launch (a speculative step)."""
        step = cls(None, None, [])
        step._result = result
        return step

    def ready(self) -> bool:
        if self._sample_later is not None:
            return False
        if self.finished is not None:
            return self.finished.query()
        return self._staged is None or self._staged.done is None or self._staged.done.query()

    def wait(self) -> StepResult:
        self.sample()
        if self.finished is not None:
            self.finished.synchronize()
        if self._result is None:
            self._result = StepResult([], []) if self._staged is None else self._staged.read(self._rows)
            self._result.prompt_logprobs = self._prompt_logprobs
        return self._result


@dataclass(slots=True)
class TokenFeed:
    """The first len(rows) decode rows of a step take their input token from `source`'s sampled
    tokens on the device, row rows[i] for row i (their host `token_ids` are placeholders)."""

    source: PendingStep
    rows: list[int]


@dataclass(slots=True)
class StepPlan:
    decode: list[PlannedRow] = field(default_factory=list)  # one token each, context > 0
    prefill: list[PlannedRow] = field(default_factory=list)  # chunks, after the decode rows
    feed: TokenFeed | None = None
    # Prefix-cache copies: hits restored and end-of-request snapshots saved before the forward; snapshots
    # at a cache point a chunk ends on, after it. Both run in order, on every rank.
    copies_before: list[CacheCopy] = field(default_factory=list)
    copies_after: list[CacheCopy] = field(default_factory=list)
    # Speculative decoding: the drafts each `drafts` row gets (0: the MTP head does not run this step).
    # Such a step is read during its launch: acceptance decides the rows' lengths.
    num_drafts: int = 0
    # Benchmark only ("accept" drafts): every verify row accepts its drafts up to its acceptance cap,
    # whatever the target samples.
    force_accept: bool = False
    # Penalties counted on the device (engine/penalty_counts.py), applied before the step samples: the
    # (slot, token) outputs the host has seen since the last launch, then the slots' rows rewritten for
    # requests that got them.
    penalty_tokens: list[tuple[int, int]] = field(default_factory=list)
    penalty_resets: list[PenaltyReset] = field(default_factory=list)

    @property
    def rows(self) -> list[PlannedRow]:
        return self.decode + self.prefill


@dataclass(slots=True)
class SpeculationResult:
    """A speculative step's outcome per sampled row, in row order."""

    # The tokens the row emits: a verify row's accepted drafts and then the target's token after them
    # (1 + accepted); one token for any other row.
    emitted: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]  # parallel to emitted
    drafts: list[list[int]]  # proposals for the positions after the emitted tokens ([] without drafting)
    num_drafted: list[int]  # drafts the row verified this step (0 for a row that is not a verify row)


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]  # one per sampled row, in row order (a verify row: its first emitted token)
    logprobs: list[TokenLogprobs | None]  # parallel to token_ids
    prompt_logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)  # per row, if any scored
    speculation: SpeculationResult | None = None


@dataclass(slots=True)
class StagedResult:
    """A step's sampled tokens (and logprobs) on their way to pinned host memory; `done` marks the end
    of the copies on CUDA (None on CPU, where the copies are synchronous)."""

    tensors: list[torch.Tensor]  # token ids, then sampled logprob, rank, top ids, top logprobs
    done: torch.cuda.Event | None
    buffers: list[torch.Tensor] = field(default_factory=list)  # reused page-locked buffers (CUDA)

    @classmethod
    def start(cls, sources: list[torch.Tensor]) -> StagedResult:
        device = sources[0].device
        if device.type != "cuda":
            return cls([t.clone() for t in sources], None)
        buffers = [PINNED.take(t.numel(), t.dtype) for t in sources]
        staged = [buf[: t.numel()].view(t.shape) for buf, t in zip(buffers, sources, strict=True)]
        for host, dev in zip(staged, sources, strict=True):
            host.copy_(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(staged, done, buffers)

    def read(self, rows: Sequence[SamplingRow]) -> StepResult:
        if self.done is not None:
            self.done.synchronize()  # this step's copies only: later launches are not waited for
        values = [t.tolist() for t in self.tensors]
        for buf in self.buffers:  # read: nothing pending on them (a result never read keeps its own)
            PINNED.give_back(buf)
        self.buffers, self.tensors = [], []  # read once: the buffers now serve later steps
        token_ids = values[0]
        if len(values) == 1:
            return StepResult(token_ids, [None] * len(rows))
        sampled, ranks, top_ids, top_lps = values[1:]
        logprobs: list[TokenLogprobs | None] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                logprobs.append(None)
            else:
                pairs = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                logprobs.append(TokenLogprobs(sampled[i], ranks[i], pairs))
        return StepResult(token_ids, logprobs)


def sample_and_stage(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow], fed: torch.Tensor | None = None
) -> tuple[torch.Tensor, StagedResult]:
    """One token per row (grammars masked first), and their copy to the host started: the sampled ids
    on the device, and the staged ids and logprobs. `fed`: the input tokens of the step's first rows,
    on the device (penalties count them: Sampler)."""
    if any(row.grammar is not None for row in rows):
        apply_grammars(logits, [row.grammar for row in rows])
    out = sampler(logits, rows, fed)
    sources = [out.token_ids]
    if out.logprobs is not None:
        lp = out.logprobs
        sources += [lp.sampled_logprob, lp.sampled_rank, lp.top_ids, lp.top_logprobs]
    return out.token_ids, StagedResult.start(sources)
