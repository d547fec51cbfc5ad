"""One-row GEMV for batch-1 decode: y = x @ W^T with x [1, K] and W [N, K] row-major.

At one row a linear layer is a pure stream of its weight; cuBLAS's M = 1 kernels reach 2.0-3.7 TB/s
on an H200 at the Qwen3.5-4B shapes (worst on the N = 2560 projections), this kernel 2.8-3.9 TB/s
(measured inside CUDA graphs, weights cycling through more than the L2). Each program owns BLOCK_N
output rows and streams them over K with an elementwise fp32 accumulator [BLOCK_N, BLOCK_K], reduced
once at the end, so the inner loop is loads and FMAs only.

Numerics: products and sums in fp32, rounded once to the output dtype; the summation order differs
from cuBLAS's (as cuBLAS's differs between its own kernels), so results agree to fp32 rounding before
the final cast. The block shape is autotuned per (N, K) on the GPU; the first call at a new shape
tunes (engine warm-up makes those calls before serving, and before CUDA-graph capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.activation import _INTERPRETER, round_to

# (BLOCK_N, BLOCK_K, warps): the winners of a sweep over 4..32 x 256..1024 x 4..8 at the 4B shapes
# (few rows per program for the narrow N = 2560 projections, wider for N >= 10k).
_CONFIGS = [(4, 1024, 8), (4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8)]
_INTERPRETER_BLOCKS = (8, 64)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, round_to(y, out_ptr.dtype.element_ty), mask=row_ok)


_gemv_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in _CONFIGS],
    key=["N", "K"],
)(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] (any row stride, unit column stride); weight: [N, K] with unit column stride (row
    slices of a larger matrix are fine). Returns [1, N] in x's dtype, written into `out` when given
    (contiguous)."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row: x of shape (1, K), got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight's K is {k}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x dtype {x.dtype} differs from the weight dtype {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs a unit column stride in x and the weight")
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape (1, {n}), got {tuple(out.shape)}"
        )
    if _INTERPRETER:
        block_n, block_k = _INTERPRETER_BLOCKS
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, weight, out, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k
        )
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _gemv_tuned[grid](x, weight, out, n, k, weight.stride(0))
    return out
