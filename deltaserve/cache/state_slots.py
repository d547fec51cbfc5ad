"""Recurrent state for the Gated DeltaNet layers: the device slots and their allocator.

A slot holds one sequence's conv window ([conv_dim, K-1], model dtype) and SSM state ([HV, dk, dv],
fp32 unless a narrower dtype was asked for) in every GDN layer. Slot 0 is reserved for padding rows.
Slots are not cleared on allocation: a step whose sequence has context 0 starts from zero state
instead of reading the slot (see ops/conv1d.py and ops/gdn.py).
"""

from __future__ import annotations

import torch

DUMMY_SLOT = 0  # reserved: padding rows point here


class StateSlots:
    """Device memory: conv [layers, slots, conv_dim, K-1] and SSM [layers, slots, HV, dk, dv] state."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        conv_dim: int,
        conv_width: int,
        num_v_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"the state pool needs at least 2 slots (one is reserved), got {num_slots}")
        self.num_slots = num_slots
        self.conv = torch.zeros(
            (num_layers, num_slots, conv_dim, conv_width), dtype=conv_dtype, device=device
        )
        self.ssm = torch.zeros(
            (num_layers, num_slots, num_v_heads, key_head_dim, value_head_dim), dtype=ssm_dtype, device=device
        )

    @property
    def capacity(self) -> int:
        """Slots a sequence can hold (all but the reserved slot)."""
        return self.num_slots - 1

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) of the index-th GDN layer: [slots, conv_dim, K-1] and [slots, HV, dk, dv]."""
        return self.conv[index], self.ssm[index]


class SlotAllocator:
    """Which slots are handed out. Knows nothing of their contents."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"the state pool needs at least 2 slots (one is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("state slot pool exhausted")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
