"""One rank's cache memory on its device: the KV pages and the state slots, sized for its geometry.

The backend reads and writes these; it never decides which page or slot a sequence holds (the cache
manager does, on the scheduler's side). Under tensor parallelism every rank holds pools of the same
page and slot counts, each with its own heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.cache.copies import CacheCopy, PageCopy, StateCommit, StateRestore, StateSave
from deltaserve.cache.kv_pages import KVPages
from deltaserve.cache.snapshots import StateSnapshots
from deltaserve.cache.state_slots import StateSlots
from deltaserve.config import ModelConfig, torch_dtype


@dataclass(slots=True)
class DeviceCaches:
    kv: KVPages
    states: StateSlots
    snapshots: StateSnapshots | None = None  # the prefix cache's GDN states (None: prefix caching off)

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def copy(self, copies: Sequence[CacheCopy]) -> None:
        """Runs the copies in order (a later copy may read what an earlier one wrote)."""
        kv, states, snaps = self.kv, self.states, self.snapshots
        for c in copies:
            if isinstance(c, PageCopy):
                kv.k[:, c.dst].copy_(kv.k[:, c.src])
                kv.v[:, c.dst].copy_(kv.v[:, c.src])
            elif isinstance(c, StateSave):
                snaps.conv[:, c.snapshot].copy_(states.conv[:, c.slot])
                snaps.ssm[:, c.snapshot].copy_(states.ssm[:, c.slot])
            elif isinstance(c, StateRestore):
                states.conv[:, c.slot].copy_(snaps.conv[:, c.snapshot])
                states.ssm[:, c.slot].copy_(snaps.ssm[:, c.snapshot])
            elif isinstance(c, StateCommit):
                states.conv[:, c.dst].copy_(states.conv[:, c.src])
                states.ssm[:, c.dst].copy_(states.ssm[:, c.src])

    def clear_states(self, slots: Sequence[int]) -> None:
        """Zeroes the conv and SSM state of `slots`: the state before a sequence's first token."""
        states = self.states
        for slot in slots:
            states.conv[:, slot].zero_()
            states.ssm[:, slot].zero_()


def build_device_caches(
    cfg: ModelConfig,
    *,
    num_pages: int,
    page_size: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
    ssm_dtype: torch.dtype | None = None,
    num_snapshots: int = 0,
    num_kv_layers: int | None = None,
) -> DeviceCaches:
    """Pools for `cfg` (a rank's geometry): KV pages for `num_kv_layers` layers (default: the
    full-attention layers; the model's `num_kv_layers` adds its MTP head's layer), state slots for the
    GDN layers and, for the prefix cache, `num_snapshots` GDN state snapshots of the same dtypes. The
    SSM state dtype defaults to the checkpoint's `mamba_ssm_dtype` (float32 for Qwen3.5)."""
    kv = KVPages(
        num_layers=len(cfg.full_attention_layers) if num_kv_layers is None else num_kv_layers,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
        device=device,
    )
    states = StateSlots(
        num_layers=len(cfg.linear_attention_layers),
        num_slots=num_slots,
        conv_dim=cfg.conv_dim,
        conv_width=cfg.linear_conv_kernel_dim - 1,
        num_v_heads=cfg.linear_num_value_heads,
        key_head_dim=cfg.linear_key_head_dim,
        value_head_dim=cfg.linear_value_head_dim,
        conv_dtype=dtype,
        ssm_dtype=ssm_dtype or torch_dtype(cfg.ssm_state_dtype),
        device=device,
    )
    snapshots = None
    if num_snapshots > 0:
        snapshots = StateSnapshots(
            num_layers=states.conv.shape[0],
            num_snapshots=num_snapshots,
            conv_shape=tuple(states.conv.shape[2:]),
            ssm_shape=tuple(states.ssm.shape[2:]),
            conv_dtype=states.conv.dtype,
            ssm_dtype=states.ssm.dtype,
            device=device,
        )
    return DeviceCaches(kv, states, snapshots)
