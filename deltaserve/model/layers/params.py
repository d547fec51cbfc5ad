"""Parameters and the checkpoint tensors that fill them.

A module allocates its (possibly fused) parameters and declares, per parameter, which checkpoint
tensors fill which views of it. The loader copies each checkpoint tensor straight into its view, so
loading never holds a second copy of the model in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.model.layers.parallel import Shard


@dataclass(slots=True)
class CheckpointTensor:
    name: str  # canonical checkpoint name (HF text layout, e.g. "layers.3.self_attn.k_proj.weight")
    target: torch.Tensor  # a view of a parameter; the checkpoint tensor (or its shard) has exactly its shape
    shard: Shard | None = None  # tensor parallelism: the part of the checkpoint tensor this rank loads

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape (the target's, or the whole of which the target is a shard)."""
        local = tuple(self.target.shape)
        return local if self.shard is None else self.shard.full_shape(local)

    def copy_from(self, full: torch.Tensor) -> None:
        """Fills the target from the whole checkpoint tensor (this rank's shard of it)."""
        self.target.copy_(full if self.shard is None else self.shard.take(full))


@dataclass(slots=True)
class WeightRequirement:
    """Filled when every tensor of any one alternative is loaded (e.g. fused or per-expert MoE files)."""

    alternatives: list[list[CheckpointTensor]]


def new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def single(name: str, target: torch.Tensor, shard: Shard | None = None) -> WeightRequirement:
    return WeightRequirement([[CheckpointTensor(name, target, shard)]])


def stacked(
    param: torch.Tensor, parts: list[tuple[str, int]], shard: Shard | None = None
) -> WeightRequirement:
    """`param` is the row-wise concatenation of checkpoint tensors `parts` = [(name, rows), ...] (their
    local rows; each is sharded by `shard` when given)."""
    tensors = []
    start = 0
    for name, rows in parts:
        tensors.append(CheckpointTensor(name, param[start : start + rows], shard))
        start += rows
    if start != param.shape[0]:
        raise ValueError(f"fused parameter has {param.shape[0]} rows, parts cover {start}")
    return WeightRequirement([tensors])
