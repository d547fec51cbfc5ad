"""Executes one step on one device: reserves pages, builds the batch tensors, runs the model, samples.

The backend is the only code that mutates device state. Each `StepItem` continues one sequence by
`token_ids`; after the forward every sequence's cursor has advanced by exactly its tokens (the state
transaction: KV pages, conv/SSM state and position move together). Sampled tokens and logprobs come
back to the host in one transfer per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.cache.manager import CacheManager, SequenceCache
from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.engine.runner import CudaGraphRunner
from deltaserve.engine.sampler import Sampler, SamplerOutput, SamplingRow
from deltaserve.model.batch import BatchRow, build_forward_batch
from deltaserve.model.qwen35 import Qwen35ForCausalLM


@dataclass(slots=True)
class StepItem:
    seq: SequenceCache
    token_ids: Sequence[int]
    sampling: SamplingRow | None = None  # set: sample a token from the item's last position


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]  # one per sampled item, in item order
    logprobs: list[TokenLogprobs | None]  # parallel to token_ids


class PendingStep:
    """A launched step whose result is read later. The items' sequences must not be released, and
    their caches not touched, until `wait()` returned (the device may still be reading them)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def ready(self) -> bool:
        return True

    def wait(self) -> StepResult:
        return self._result


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
    def forward(self, items: Sequence[StepItem], *, all_logits: bool = False) -> torch.Tensor:
        """Runs all items as one varlen forward (decode items first). Returns float32 logits [R, vocab]
        for the items that sample (every item when all_logits), in item order."""
        rows = []
        for item in items:
            seq = item.seq
            self.cache.reserve(seq, seq.num_computed + len(item.token_ids))
            need = all_logits or item.sampling is not None
            rows.append(BatchRow(item.token_ids, seq.num_computed, seq.pages, seq.slot, need))
        graphs = self.graph_runner
        if graphs is not None and all(r.need_logits for r in rows) and graphs.can_run(rows):
            logits = graphs.run(rows)
        else:
            batch = build_forward_batch(rows, self.cache.page_size, self.device)
            logits = self.model.compute_logits(self.model(batch, self.cache.kv, self.cache.states))
        for item in items:
            self.cache.advance(item.seq, len(item.token_ids))
        return logits

    @torch.inference_mode()
    def execute(self, items: Sequence[StepItem]) -> StepResult:
        logits = self.forward(items)
        rows = [item.sampling for item in items if item.sampling is not None]
        if not rows:
            return StepResult([], [])
        return _to_host(self.sampler(logits, rows), rows)

    def launch(self, items: Sequence[StepItem]) -> PendingStep:
        """Starts a step whose result is read later (the overlap path). Synchronous on CPU."""
        return PendingStep(self.execute(items))


def _to_host(out: SamplerOutput, rows: Sequence[SamplingRow]) -> StepResult:
    token_ids = out.token_ids.tolist()
    if out.logprobs is None:
        return StepResult(token_ids, [None] * len(rows))
    lp = out.logprobs
    sampled, ranks = lp.sampled_logprob.tolist(), lp.sampled_rank.tolist()
    top_ids, top_lps = lp.top_ids.tolist(), lp.top_logprobs.tolist()
    logprobs: list[TokenLogprobs | None] = []
    for i, row in enumerate(rows):
        k = row.params.logprobs
        if k is None:
            logprobs.append(None)
        else:
            logprobs.append(
                TokenLogprobs(sampled[i], ranks[i], list(zip(top_ids[i][:k], top_lps[i][:k], strict=True)))
            )
    return StepResult(token_ids, logprobs)
