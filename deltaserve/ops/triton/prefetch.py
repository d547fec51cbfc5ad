"""Weight prefetch into the GPU's L2 for weight-streaming decode steps (Hopper and later).

A batch-1 decode step alternates weight-streaming GEMVs, which keep HBM busy, with short kernels (norms,
convolution, the recurrent update, attention) that leave it nearly idle for ~0.6 ms of a ~2.8 ms step at
the 4B shape. `prefetch_l2` issues the first bytes of the next GEMV's weight as bulk L2 prefetches
(`cp.async.bulk.prefetch.L2.global`, one per CHUNK bytes) and returns: the copy runs under the short
kernels that follow, and the GEMV then finds the first rows of its weight in L2.

Invariants:
- A prefetch is a hint: it writes nothing and changes no value anywhere, so a step's results are the same
  bits with and without it.
- The kernel waits (gdc_enter) before it exits, like every PDL kernel of a step: a later kernel's wait
  covers the kernels before the prefetch only because the prefetch's own wait did (pdl.py).
- Addresses and sizes are 16-byte multiples (the instruction's requirement): the byte count is rounded
  down to 16 and the tensor's start is checked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.device_info import hopper_or_later
from deltaserve.ops.triton.pdl import gdc_enter, launch_options

CHUNK_BYTES = 64 * 1024  # bytes per prefetch instruction
_LANES = 32  # prefetches per program: one per thread of its one warp


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    starts = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    sizes = tl.minimum(nbytes - starts, CHUNK)
    issue = (sizes > 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r",
        [base + starts, tl.maximum(sizes, 0).to(tl.int32), issue],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_l2(t: torch.Tensor, max_bytes: int) -> None:
    """Starts copying the first min(t's bytes, max_bytes) of `t` (a contiguous CUDA tensor) into L2."""
    if not hopper_or_later(t.device) or not t.is_contiguous():
        raise ValueError(
            "prefetch_l2 needs a contiguous tensor on a GPU of compute capability 9.0 or later, got "
            f"{t.device} strides {t.stride()}"
        )
    if t.data_ptr() % 16:
        raise ValueError(f"prefetch_l2 needs a 16-byte aligned start, got address {t.data_ptr():#x}")
    nbytes = min(t.numel() * t.element_size(), max_bytes) // 16 * 16
    if nbytes <= 0:
        return
    grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK_BYTES), _LANES),)
    _l2_prefetch_kernel[grid](
        t.data_ptr(), nbytes, CHUNK=CHUNK_BYTES, LANES=_LANES, num_warps=1, **launch_options(t.device)
    )
