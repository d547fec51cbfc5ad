"""Tensor-parallel sums of small tensors by one-shot peer reads (PyTorch symmetric memory), in place of
NCCL's all-reduce: opt-in with DELTASERVE_TP_ALLREDUCE=peer (CUDA, one rank per GPU, NCCL group).

Each rank owns a buffer of MAX_BYTES that every peer can read over NVLink. A sum copies the input into
the local buffer; `symm_mem.one_shot_all_reduce_out` then waits until every rank's buffer holds its
input (a barrier on the signal pads), adds the peers' buffers in rank order into the output, and waits
again until every rank has read, so the next sum may overwrite the buffer. Every rank adds in the same
order, so the ranks' residual streams stay bit-identical. One copy and one kernel per sum, where NCCL's
ring took ~20 us at decode sizes (docs/benchmarks/2026-12-04-h200x2-tensor-parallel.md: 128 all-reduces
per 27B step, the suspected gap between TP2's 0.64x and the 0.6x target).

The reads are plain peer loads: NVLink multicast (multimem) is never used, and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the buffer is made, so rendezvous creates no multicast
object. Tensors over MAX_BYTES (prefill steps) keep NCCL: a one-shot sum reads every peer's whole
tensor, which a ring beats at those sizes. Every rank makes the same sums in the same order (steps pass
the start gate together), so the barriers pair up; the kernel is captured in CUDA graphs like any other.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from deltaserve.errors import ConfigError

MODE_ENV = "DELTASERVE_TP_ALLREDUCE"
MODES = ("nccl", "peer")
# Decode and verify steps: 27B rows are 10 KiB (hidden 5,120 in bf16), so up to ~400 rows a step.
MAX_BYTES = 4 << 20

# (buffer, reduce_op, group_name, out) -> out: torch.ops.symm_mem.one_shot_all_reduce_out's signature.
OneShot = Callable[[torch.Tensor, str, str, torch.Tensor], torch.Tensor]


def peer_all_reduce_wanted() -> bool:
    """Whether DELTASERVE_TP_ALLREDUCE asks for peer sums ("nccl", the default, or "peer")."""
    mode = os.environ.get(MODE_ENV, "nccl")
    if mode not in MODES:
        raise ConfigError(f"{MODE_ENV} must be one of {list(MODES)}, got {mode!r}")
    return mode == "peer"


class PeerAllReduce:
    """A rank's symmetric buffer and the one-shot sum over it; `create` makes one on every rank."""

    def __init__(self, buffer: torch.Tensor, group_name: str, one_shot: OneShot) -> None:
        self.buffer = buffer  # MAX_BYTES of the model's dtype, readable by every peer
        self.group_name = group_name
        self._one_shot = one_shot

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype) -> PeerAllReduce:
        """A collective: every rank of the default (NCCL) group calls it at the same point."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        if dist.get_backend() != "nccl":
            raise ConfigError(
                f"{MODE_ENV}=peer needs one rank per GPU over NCCL, got the {dist.get_backend()!r} backend"
            )
        one_shot = getattr(torch.ops.symm_mem, "one_shot_all_reduce_out", None)
        if one_shot is None:
            raise ConfigError(
                f"{MODE_ENV}=peer needs torch.ops.symm_mem.one_shot_all_reduce_out (PyTorch >= 2.7)"
            )
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        group_name = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # older PyTorch releases need it before a rendezvous; newer ones warn
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group_name)
        buffer = symm_mem.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
        return cls(buffer, group_name, one_shot)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` can be summed here: the buffer's dtype and device, contiguous, at most MAX_BYTES."""
        return (
            x.dtype == self.buffer.dtype
            and x.device == self.buffer.device
            and x.is_contiguous()
            and x.numel() <= self.buffer.numel()
        )

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place (`fits(x)` must hold)."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        staged.copy_(flat)
        self._one_shot(staged, "sum", self.group_name, flat)
        return x
