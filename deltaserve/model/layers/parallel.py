"""Tensor parallelism inside the model (Megatron style).

Every rank holds the same replicated tensors (embedding, LM head, norms, the MoE router) and a shard of
the rest: full attention by whole heads (a head's [query | gate] rows stay together) and kv heads, Gated
DeltaNet by key and value heads (q, k, v, z, b, a, the conv channels, A_log and dt_bias of the local
heads; each rank's conv and SSM state hold only those heads), the dense MLP and every expert by
intermediate columns. The projections back into the residual stream (o_proj, out_proj, down_proj and the
MoE output) produce partial sums that one all-reduce per mixer and one per MLP complete; everything
between them is rank-local. Conv and SSM states are never reduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deltaserve.model.layers.peer_all_reduce import PeerAllReduce


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # Sums of small tensors by one-shot peer reads instead of NCCL (DELTASERVE_TP_ALLREDUCE=peer).
    peer: PeerAllReduce | None = field(default=None, compare=False)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place (the default process group); a no-op on one rank."""
        if self.size > 1:
            if self.peer is not None and self.peer.fits(x):
                self.peer.all_reduce_(x)
            else:
                dist.all_reduce(x)
        return x

    def shard(self, dim: int, segments: tuple[int, ...] | None = None) -> Shard | None:
        """This rank's part along `dim` (of each segment of a fused tensor); None on one rank."""
        if self.size == 1:
            return None
        return Shard(dim, self.rank, self.size, segments)


SINGLE = TensorParallel()


@dataclass(frozen=True, slots=True)
class Shard:
    """A rank's part of a checkpoint tensor: along `dim`, chunk `rank` of `size` equal chunks of each
    segment. `segments` are the full sizes of the pieces a fused tensor concatenates along `dim` (GDN's
    q | k | v channels); None means one segment spanning the dimension."""

    dim: int
    rank: int
    size: int
    segments: tuple[int, ...] | None = None

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = sum(self.segments) if self.segments else local[self.dim] * self.size
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        segments = self.segments or (full.shape[self.dim],)
        parts, start = [], 0
        for length in segments:
            chunk = length // self.size
            parts.append(full.narrow(self.dim, start + self.rank * chunk, chunk))
            start += length
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
