"""Executes one step on one device: reserves pages, builds the batch tensors, runs the model.

The backend is the only code that mutates device state. Each `StepItem` continues one sequence by
`token_ids`; after the forward every sequence's cursor has advanced by exactly its tokens (the state
transaction: KV pages, conv/SSM state and position move together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.cache.manager import CacheManager, SequenceCache
from deltaserve.model.batch import BatchRow, build_forward_batch
from deltaserve.model.qwen35 import Qwen35ForCausalLM


@dataclass(slots=True)
class StepItem:
    seq: SequenceCache
    token_ids: Sequence[int]
    need_logits: bool = True  # logits for the item's last token


class Backend:
    def __init__(self, model: Qwen35ForCausalLM, cache: CacheManager) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device

    @torch.inference_mode()
    def forward(self, items: Sequence[StepItem]) -> torch.Tensor:
        """Runs all items as one varlen forward (decode items should come first). Returns float32
        logits [R, vocab] for the items with need_logits, in item order."""
        rows = []
        for item in items:
            seq = item.seq
            self.cache.reserve(seq, seq.num_computed + len(item.token_ids))
            rows.append(BatchRow(item.token_ids, seq.num_computed, seq.pages, seq.slot, item.need_logits))
        batch = build_forward_batch(rows, self.cache.page_size, self.device)
        hidden = self.model(batch, self.cache.kv, self.cache.states)
        for item in items:
            self.cache.advance(item.seq, len(item.token_ids))
        return self.model.compute_logits(hidden)
