"""Drives a backend row by row, as tests of the model need: the cache manager reserves each row's pages
before the forward and advances its cursor after it, exactly as the scheduler does for a step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.cache.manager import CacheManager, SequenceCache
from deltaserve.engine.backend import Backend
from deltaserve.ops.batch import BatchRow


@dataclass(slots=True)
class StepItem:
    seq: SequenceCache
    token_ids: Sequence[int]


class Driver:
    def __init__(self, backend: Backend, cache: CacheManager) -> None:
        self.backend = backend
        self.cache = cache
        self.model = backend.model
        self.caches = backend.caches
        self.device = backend.device

    def rows(self, items: Sequence[StepItem]) -> list[BatchRow]:
        """Reserves each item's pages and returns its batch row (every row asks for logits)."""
        rows = []
        for item in items:
            seq = item.seq
            self.cache.reserve(seq, seq.num_computed + len(item.token_ids))
            rows.append(BatchRow(item.token_ids, seq.num_computed, seq.pages, seq.slot))
        return rows

    def advance(self, items: Sequence[StepItem]) -> None:
        for item in items:
            self.cache.advance(item.seq, len(item.token_ids))

    def forward(self, items: Sequence[StepItem], all_logits: bool = True) -> torch.Tensor:
        """One forward over the items (decode items first); float32 logits [len(items), vocab]."""
        assert all_logits, "every row returns its last token's logits"
        logits = self.backend.logits(self.rows(items))
        self.advance(items)
        return logits
