"""The state transaction of a hybrid model: KV pages, state slot and position of a sequence move together.

A `SequenceCache` is one sequence's claim on both pools. Invariant, checked at every boundary:
    num_computed == tokens whose K/V are in `pages` == tokens absorbed into the slot's conv/SSM state.
`reserve` only adds pages (it never changes what is computed); `advance` moves the position after a
forward has written both kinds of state; `release` returns pages and slot in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.cache.kv_pages import KVPagePool
from deltaserve.cache.state_slots import StateSlotPool
from deltaserve.config import DTYPES, ModelConfig


@dataclass(slots=True)
class SequenceCache:
    slot: int
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # the cursor: KV length == state length == this
    released: bool = False


class CacheManager:
    def __init__(self, kv: KVPagePool, states: StateSlotPool) -> None:
        self.kv = kv
        self.states = states

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def can_open(self, num_tokens: int) -> bool:
        return self.states.num_free > 0 and self.kv.pages_for(num_tokens) <= self.kv.num_free

    def open(self, num_tokens: int = 0) -> SequenceCache:
        """Claims a state slot and pages for `num_tokens` positions (both or neither)."""
        pages = self.kv.allocate(self.kv.pages_for(num_tokens))
        try:
            slot = self.states.allocate()
        except MemoryError:
            self.kv.free(pages)
            raise
        return SequenceCache(slot=slot, pages=pages)

    def pages_needed(self, seq: SequenceCache, total_tokens: int) -> int:
        return max(0, self.kv.pages_for(total_tokens) - len(seq.pages))

    def reserve(self, seq: SequenceCache, total_tokens: int) -> None:
        """Makes `seq` hold pages for `total_tokens` positions."""
        self._check_live(seq)
        need = self.pages_needed(seq, total_tokens)
        if need:
            seq.pages.extend(self.kv.allocate(need))

    def advance(self, seq: SequenceCache, num_tokens: int) -> None:
        """Records that a forward wrote `num_tokens` more positions into both KV and state."""
        self._check_live(seq)
        new_total = seq.num_computed + num_tokens
        if new_total > len(seq.pages) * self.page_size:
            raise AssertionError(f"sequence advanced to {new_total} tokens past its {len(seq.pages)} pages")
        seq.num_computed = new_total

    def release(self, seq: SequenceCache) -> None:
        """Returns the sequence's pages and slot. Idempotent: a second release is a no-op."""
        if seq.released:
            return
        self.kv.free(seq.pages)
        self.states.free(seq.slot)
        seq.pages = []
        seq.released = True

    @staticmethod
    def _check_live(seq: SequenceCache) -> None:
        if seq.released:
            raise AssertionError("use of a released sequence cache")


def build_cache(
    cfg: ModelConfig,
    *,
    num_pages: int,
    page_size: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
    ssm_dtype: torch.dtype | None = None,
) -> CacheManager:
    """Pools for `cfg`: KV pages for the full-attention layers, state slots for the GDN layers. The SSM
    state dtype defaults to the checkpoint's `mamba_ssm_dtype` (float32 for Qwen3.5)."""
    kv = KVPagePool(
        num_layers=len(cfg.full_attention_layers),
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
        device=device,
    )
    states = StateSlotPool(
        num_layers=len(cfg.linear_attention_layers),
        num_slots=num_slots,
        conv_dim=cfg.conv_dim,
        conv_width=cfg.linear_conv_kernel_dim - 1,
        num_v_heads=cfg.linear_num_value_heads,
        key_head_dim=cfg.linear_key_head_dim,
        value_head_dim=cfg.linear_value_head_dim,
        conv_dtype=dtype,
        ssm_dtype=ssm_dtype or DTYPES[cfg.ssm_state_dtype],
        device=device,
    )
    return CacheManager(kv, states)
