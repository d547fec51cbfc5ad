"""The decode GEMV with its weight streamed through TMA (Hopper's tensor memory accelerator), an experiment
for batch-1 decode, called by the model only with DELTASERVE_GEMV_TMA=1 (ops/settings.py).

The pointer GEMV (linear.py) holds each program's weight tile in registers, so the bytes in flight per SM
are bounded by how many programs its registers hold: at the 4B shapes its layer projections stream at
~76% of an H200's HBM bandwidth against ~93% for the much larger LM head
(docs/benchmarks/2026-12-06-h100-l2-prefetch.md). Here each program's weight tiles come into shared
memory through a host-built tensor descriptor, STAGES - 1 tiles ahead of the one being summed (Triton's
loop pipeliner issues the bulk copies and their barriers), so shared memory, not registers, sets the
bytes in flight.

Measured on an H100 (docs/benchmarks/2026-12-06-h100-gemv-tma.md): 3-16% slower than the pointer GEMV
on the 4B's layer projections at every launch shape tried, level on the LM head, so the bytes in flight
are not what holds the pointer GEMV back there; an H200, with ~40% more bandwidth to cover, is not yet
measured.

Numerics are the pointer GEMV's: an elementwise fp32 accumulator [BLOCK_N, BLOCK_K] per row, reduced once
at the end, so at the same (BLOCK_N, BLOCK_K) the two give the same bits. Plain rows only, with the PDL
wait of a decode step's kernels but no fusion and no L2 prefetch: `python3 -m deltaserve.bench.linear_kernel
--tma` measures it against the pointer GEMV before anything else is built on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deltaserve.ops.triton.activation import round_to
from deltaserve.ops.triton.pdl import gdc_enter, launch_options

MAX_ROWS = 4


@dataclass(frozen=True)
class TmaBlocks:
    """One launch shape: output rows and K columns per weight tile, warps, and pipeline stages (tiles
    in shared memory: STAGES - 1 of them in flight while one is summed)."""

    block_n: int
    block_k: int
    warps: int
    stages: int


# Candidates for the autotuner: tiles of 2-16 KB, 4-8 stages (16-64 KB of shared memory a program), no
# tile dimension over 256 (a TMA box's limit, so no launch depends on how Triton splits a larger tile).
CONFIGS = [
    TmaBlocks(8, 256, 4, 4),
    TmaBlocks(16, 256, 4, 4),
    TmaBlocks(16, 256, 4, 6),
    TmaBlocks(32, 256, 8, 4),
    TmaBlocks(8, 128, 4, 8),
    TmaBlocks(32, 128, 4, 6),
]
INTERPRETER_BLOCKS = TmaBlocks(8, 64, 4, 2)


@triton.jit
def _gemv_tma_kernel(
    w_desc,
    x_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_om,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)  # the PDL wait (ops/triton/pdl.py) before any load: tiles stream after it
    # The descriptor pads a tile past N or K with zeros, so only x's columns and the stored rows need
    # masks; tiles arrive STAGES - 1 ahead of the loop body through shared memory.
    n0 = tl.program_id(0) * BLOCK_N
    accs = ()
    for _r in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32),)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0]).to(tl.float32)
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        new_accs = ()
        for r in tl.static_range(ROWS):
            x = tl.load(x_ptr + r * stride_xm + cols, mask=col_ok, other=0.0).to(tl.float32)
            new_accs = new_accs + (accs[r] + w * x[None, :],)
        accs = new_accs
    rows = n0 + tl.arange(0, BLOCK_N)
    for r in tl.static_range(ROWS):
        y = round_to(tl.sum(accs[r], axis=1), out_ptr.dtype.element_ty)
        tl.store(out_ptr + r * stride_om + rows, y, mask=rows < N)


def _set_block_shape(nargs: dict) -> None:
    """An autotuner config's pre-hook: the host descriptor's tile is the config's."""
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


_gemv_tma_tuned = triton.autotune(
    configs=[
        triton.Config(
            {"BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "STAGES": c.stages},
            num_warps=c.warps,
            num_stages=c.stages,
            pre_hook=_set_block_shape,
        )
        for c in CONFIGS
    ],
    key=["N", "K", "ROWS"],
    cache_results=True,
)(_gemv_tma_kernel)


def tma_refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """What stops gemv_tma from taking (x, weight), or None. A descriptor needs a 16-bit weight with unit
    column stride, a 16-byte-aligned base and row stride."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        return f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}"
    if weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"weight must be [N, K] with K = {x.shape[1]} (x's columns), got {tuple(weight.shape)}"
    if weight.dtype not in (torch.bfloat16, torch.float16) or x.dtype != weight.dtype:
        return f"x and weight must share a 16-bit dtype, got {x.dtype} and {weight.dtype}"
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return "x and weight need a unit column stride"
    if weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16:
        return (
            f"the weight's base and row stride must be 16-byte aligned, got base % 16 = "
            f"{weight.data_ptr() % 16} and a row stride of {weight.stride(0)} elements"
        )
    return None


def gemv_tma(x: torch.Tensor, weight: torch.Tensor, *, blocks: TmaBlocks | None = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS, any row stride) @ weight [N, K]^T -> [M, N] in x's dtype, the weight
    streamed once through TMA. `blocks` fixes the launch shape (otherwise autotuned per N, K and M)."""
    problem = tma_refusal(x, weight)
    if problem is not None:
        raise ValueError(f"gemv_tma: {problem}")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if blocks is None and x.device.type != "cuda":
        blocks = INTERPRETER_BLOCKS
    # Autotuned, each config's pre-hook sets the descriptor's tile to its own.
    tile = [8, 64] if blocks is None else [blocks.block_n, blocks.block_k]
    w_desc = TensorDescriptor.from_tensor(weight, tile)
    args = (w_desc, x, out, n, k, x.stride(0), out.stride(0))
    if blocks is None:
        _gemv_tma_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            *args, ROWS=m, **launch_options(x.device)
        )
    else:
        _gemv_tma_kernel[(triton.cdiv(n, blocks.block_n),)](
            *args,
            ROWS=m,
            BLOCK_N=blocks.block_n,
            BLOCK_K=blocks.block_k,
            STAGES=blocks.stages,
            num_warps=blocks.warps,
            num_stages=blocks.stages,
            **launch_options(x.device),
        )
    return out
