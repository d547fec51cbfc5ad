"""Executes one step on one device: reserves pages, builds the batch tensors, runs the model, samples.

The backend is the only code that mutates device state. Each `StepItem` continues one sequence by
`token_ids`; after the forward every sequence's cursor has advanced by exactly its tokens (the state
transaction: KV pages, conv/SSM state and position move together). Sampled tokens and logprobs come
back to the host in one transfer per step; prompt logprobs, where a request asked for them, are computed
and read back during the launch (a synchronous step for those rows).

`launch` returns before the device has finished: the step's results are copied into pinned host memory
behind an event, so waiting for them never waits for steps launched later. A launch may take the input
token of its first rows from an earlier, still running step's sampled tokens on the device (a
`TokenFeed`): decode step N+1 is launched before step N's tokens reach the host.

All device work runs in launch order on one stream. Even so, the scheduler releases a sequence's
pages and slot only after every launched step over it has been waited for, so the rule holds for any
future second stream as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deltaserve.cache.manager import CacheManager, SequenceCache
from deltaserve.engine.cuda_graphs import CudaGraphRunner
from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.engine.sampler import Sampler, SamplerOutput, SamplingRow, logprobs_of
from deltaserve.engine.structured import apply_grammars
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, build_forward_batch, to_device

SCORE_BLOCK = 256  # prompt positions whose full-vocabulary logits exist at once


@dataclass(slots=True)
class PromptScoring:
    """Prompt logprobs for an item: the distribution after its token i scores `targets[i]` (the next
    prompt token), for the first len(targets) tokens of the item, with the `k` most likely tokens."""

    targets: list[int]
    k: int


@dataclass(slots=True)
class StepItem:
    seq: SequenceCache
    token_ids: Sequence[int]
    sampling: SamplingRow | None = None  # set: sample a token from the item's last position
    scoring: PromptScoring | None = None


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]  # one per sampled item, in item order
    logprobs: list[TokenLogprobs | None]  # parallel to token_ids
    prompt_logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)  # per item, if any scored


class PendingStep:
    """A launched step whose result is read later. `token_ids` holds the sampled tokens on the device
    (what a later step's TokenFeed reads); `wait()` returns the host copy."""

    def __init__(
        self,
        token_ids: torch.Tensor | None,
        staged: _StagedResult | None,
        rows: Sequence[SamplingRow],
        prompt_logprobs: list[list[TokenLogprobs] | None] | None = None,
    ) -> None:
        self.token_ids = token_ids  # [sampled items] int64 on the device; None when nothing samples
        self._staged = staged
        self._rows = rows
        self._prompt_logprobs = prompt_logprobs or []
        self._result: StepResult | None = None

    def ready(self) -> bool:
        return self._staged is None or self._staged.done is None or self._staged.done.query()

    def wait(self) -> StepResult:
        if self._result is None:
            self._result = StepResult([], []) if self._staged is None else self._staged.read(self._rows)
            self._result.prompt_logprobs = self._prompt_logprobs
        return self._result


@dataclass(slots=True)
class TokenFeed:
    """The first len(rows) items of a step take their input token from `source`'s sampled tokens on
    the device, row rows[i] for item i (their host `token_ids` are placeholders)."""

    source: PendingStep
    rows: list[int]


class Backend:
    def __init__(
        self,
        model: Qwen35ForCausalLM,
        cache: CacheManager,
        sampler: Sampler | None = None,
        graph_runner: CudaGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler or Sampler()
        self.graph_runner = graph_runner
        self.device = model.device

    @torch.inference_mode()
    def forward(
        self, items: Sequence[StepItem], *, all_logits: bool = False, feed: TokenFeed | None = None
    ) -> torch.Tensor:
        """Runs all items as one varlen forward (decode items first). Returns float32 logits [R, vocab]
        for the items that sample (every item when all_logits), in item order."""
        return self._forward(items, all_logits, feed)[0]

    def _forward(
        self, items: Sequence[StepItem], all_logits: bool, feed: TokenFeed | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(), plus the final hidden states of the items' scored prompt tokens (item order)."""
        rows = []
        for item in items:
            seq = item.seq
            self.cache.reserve(seq, seq.num_computed + len(item.token_ids))
            need = all_logits or item.sampling is not None
            scored = len(item.scoring.targets) if item.scoring is not None else 0
            rows.append(BatchRow(item.token_ids, seq.num_computed, seq.pages, seq.slot, need, scored))
        fed = None
        if feed is not None:
            _check_fed_rows(rows, len(feed.rows))
            fed = _fed_tokens(feed, self.device)
        logits, scored_hidden = self.run_rows(rows, fed)
        for item in items:
            self.cache.advance(item.seq, len(item.token_ids))
        return logits, scored_hidden

    def run_rows(
        self, rows: list[BatchRow], fed: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward over `rows` (a decode graph when one fits): logits of the rows that need them, and
        the hidden states of the scored tokens (None when no row scores)."""
        graphs = self.graph_runner
        scoring = any(r.scored for r in rows)
        if graphs is not None and not scoring and all(r.need_logits for r in rows) and graphs.can_run(rows):
            return graphs.run(rows, fed), None
        batch = build_forward_batch(rows, self.cache.page_size, self.device)
        if fed is not None:
            batch.input_ids[: fed.shape[0]] = fed
        hidden = self.model(batch, self.cache.kv, self.cache.states)
        sampled = sum(r.need_logits for r in rows)
        return self.model.compute_logits(hidden[:sampled]), hidden[sampled:] if scoring else None

    def _score_prompts(
        self, items: Sequence[StepItem], hidden: torch.Tensor
    ) -> list[list[TokenLogprobs] | None]:
        """Prompt logprobs of the scored items, from the raw distribution, SCORE_BLOCK positions at a time."""
        out: list[list[TokenLogprobs] | None] = []
        offset = 0
        for item in items:
            if item.scoring is None:
                out.append(None)
                continue
            scoring, scored = item.scoring, []
            for start in range(0, len(scoring.targets), SCORE_BLOCK):
                targets = scoring.targets[start : start + SCORE_BLOCK]
                rows = hidden[offset + start : offset + start + len(targets)]
                lp = logprobs_of(
                    self.model.compute_logits(rows), to_device(targets, torch.int64, self.device), scoring.k
                )
                for logprob, rank, ids, values in zip(
                    lp.sampled_logprob.tolist(),
                    lp.sampled_rank.tolist(),
                    lp.top_ids.tolist(),
                    lp.top_logprobs.tolist(),
                    strict=True,
                ):
                    scored.append(TokenLogprobs(logprob, rank, list(zip(ids, values, strict=True))))
            offset += len(scoring.targets)
            out.append(scored)
        return out

    def execute(self, items: Sequence[StepItem]) -> StepResult:
        return self.launch(items).wait()

    @torch.inference_mode()
    def launch(self, items: Sequence[StepItem], *, feed: TokenFeed | None = None) -> PendingStep:
        """Runs the forward and the sampler and starts copying the results to the host; returns without
        waiting for the device. The sequences have advanced when this returns."""
        logits, scored_hidden = self._forward(items, False, feed)
        prompt = None if scored_hidden is None else self._score_prompts(items, scored_hidden)
        rows = [item.sampling for item in items if item.sampling is not None]
        if not rows:
            return PendingStep(None, None, rows, prompt)
        if any(row.grammar is not None for row in rows):
            apply_grammars(logits, [row.grammar for row in rows])
        out = self.sampler(logits, rows)
        return PendingStep(out.token_ids, _StagedResult.start(out), rows, prompt)


def _fed_tokens(feed: TokenFeed, device: torch.device) -> torch.Tensor:
    source = feed.source.token_ids
    if source is None:
        raise ValueError("a token feed needs a source step that sampled tokens")
    n = len(feed.rows)
    if feed.rows == list(range(n)):
        return source[:n]
    return source.index_select(0, to_device(feed.rows, torch.int64, device))


def _check_fed_rows(rows: Sequence[BatchRow], fed: int) -> None:
    if fed > len(rows) or any(len(r.token_ids) != 1 for r in rows[:fed]):
        raise ValueError(
            f"a token feed covers {fed} rows; each must be one of the step's first one-token rows"
        )


@dataclass(slots=True)
class _StagedResult:
    """A step's sampled tokens (and logprobs) on their way to pinned host memory; `done` marks the end
    of the copies on CUDA (None on CPU, where the copies are synchronous)."""

    tensors: list[torch.Tensor]  # token ids, then sampled logprob, rank, top ids, top logprobs
    done: torch.cuda.Event | None

    @classmethod
    def start(cls, out: SamplerOutput) -> _StagedResult:
        device = out.token_ids.device
        sources = [out.token_ids]
        if out.logprobs is not None:
            lp = out.logprobs
            sources += [lp.sampled_logprob, lp.sampled_rank, lp.top_ids, lp.top_logprobs]
        if device.type != "cuda":
            return cls([t.clone() for t in sources], None)
        staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in sources]
        for host, dev in zip(staged, sources, strict=True):
            host.copy_(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(staged, done)

    def read(self, rows: Sequence[SamplingRow]) -> StepResult:
        if self.done is not None:
            self.done.synchronize()  # this step's copies only: later launches are not waited for
        token_ids = self.tensors[0].tolist()
        if len(self.tensors) == 1:
            return StepResult(token_ids, [None] * len(rows))
        sampled, ranks, top_ids, top_lps = (t.tolist() for t in self.tensors[1:])
        logprobs: list[TokenLogprobs | None] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                logprobs.append(None)
            else:
                pairs = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                logprobs.append(TokenLogprobs(sampled[i], ranks[i], pairs))
        return StepResult(token_ids, logprobs)
