"""Weight prefetch into the GPU's L2 for weight-streaming decode steps (Hopper and later).

A batch-1 decode step alternates weight-streaming GEMVs, which keep HBM busy, with short kernels (norms,
convolution, the recurrent update, attention) that leave it nearly idle for ~0.6 ms of a ~2.8 ms step at
the 4B shape. A GEMV given the next projection's weight (ops/triton/linear.py) ends each of its programs by
issuing that program's share of the weight's first bytes as a bulk L2 prefetch
(`cp.async.bulk.prefetch.L2.global`, `issue_share`): the copy runs under the short kernels that follow,
and the next GEMV finds the first rows of its weight in L2. A step's first projection, which no GEMV
precedes, takes a kernel of its own (`prefetch_l2`).

Invariants:
- A prefetch is a hint: it writes nothing and changes no value anywhere, so a step's results are the same
  bits with and without it.
- Riding on the GEMV adds no kernel to a step: a launch in a CUDA graph costs about as much as a short
  kernel's whole run (docs/benchmarks/2026-12-04-h200-c1-fusions-graph-attention.md).
- The kernel of its own waits (gdc_enter) before it issues anything, like every PDL kernel of a step: a
  later kernel's wait covers the kernels before the prefetch only because the prefetch's own wait did.
- Addresses and sizes are 16-byte multiples (the instruction's requirement): byte counts are rounded down
  to 16, shares up to 16, and a tensor's start is checked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.device_info import hopper_or_later
from deltaserve.ops.triton.pdl import gdc_enter, launch_options

CHUNK_BYTES = 256 * 1024  # bytes per program of the kernel of its own


@triton.jit
def issue_share(base, nbytes):
    """This program's share of bytes [0, nbytes) after `base` (an address; nbytes a multiple of 16),
    prefetched into L2 by its first thread. Programs in launch order take consecutive shares."""
    share = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), 16) * 16
    start = tl.program_id(0).to(tl.int64) * share
    size = tl.minimum(nbytes - start, share).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.gt.s32 q, $2, 0;"
        " and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r",
        [base + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_kernel(base, nbytes, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    issue_share(base, nbytes)


def prefetch_bytes(t: torch.Tensor, max_bytes: int) -> int:
    """How many of `t`'s first bytes a prefetch of up to `max_bytes` takes (a multiple of 16); refuses a
    tensor the instruction cannot take."""
    if not hopper_or_later(t.device) or not t.is_contiguous():
        raise ValueError(
            "a prefetch needs a contiguous tensor on a GPU of compute capability 9.0 or later, got "
            f"{t.device} strides {t.stride()}"
        )
    if t.data_ptr() % 16:
        raise ValueError(f"a prefetch needs a 16-byte aligned start, got address {t.data_ptr():#x}")
    return min(t.numel() * t.element_size(), max_bytes) // 16 * 16


def prefetch_l2(t: torch.Tensor, max_bytes: int) -> None:
    """Starts copying the first min(t's bytes, max_bytes) of `t` (a contiguous CUDA tensor) into L2, from
    a kernel of its own."""
    nbytes = prefetch_bytes(t, max_bytes)
    if nbytes > 0:
        grid = (triton.cdiv(nbytes, CHUNK_BYTES),)
        _l2_prefetch_kernel[grid](t.data_ptr(), nbytes, num_warps=1, **launch_options(t.device))
