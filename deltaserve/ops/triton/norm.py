"""The RMSNorms of Qwen3.5 on the GPU: zero-centred RMSNorm (optionally fused with the residual add) and
the GDN output's per-head gated RMSNorm.

Numerics follow the torch reference (deltaserve/ops/norm.py), rounding where it rounds:
- rms_norm: with a residual, s = x + residual is rounded to the activation dtype first (it is the new
  residual) and the norm is taken of that rounded s; y = s * rsqrt(mean(s^2) + eps) * (1 + w) in fp32,
  rounded once.
- gated_rms_norm: normed = x * rsqrt(mean(x^2) + eps) rounded to x's dtype; times the weight in torch's
  promoted dtype of (weight, x); times silu(z) in fp32; rounded once.
The mean is a tree sum (not torch's order), so a bf16 result can differ from torch's by one ulp where the
fp32 value sits on a rounding boundary; rsqrt is 1 / sqrt with IEEE rounding.

Rows are addressed as (outer, inner) pairs with their own strides, so a [T, heads, D] view of a wider
projection (q from the interleaved q|gate, z from the fused GDN in_proj) is read in place. Outputs are
contiguous. One program normalises BLOCK_R rows of next_pow2(N) columns, in fp32 registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.activation import TL_DTYPES, round_to, silu_f32
from deltaserve.ops.triton.launch_shape import program_shape
from deltaserve.ops.triton.pdl import gdc_enter, launch_options

# A program's tile is about 4096 fp32 values (16 KiB): one row of a hidden state (N up to 5120 needs an
# 8192-wide tile and 8 warps), 16 rows of q/k heads (256) or 32 of GDN heads (128). That keeps 32 values per
# thread, enough bytes in flight per SM without spilling registers.
_TILE = 4096


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """t as [outer, inner, N] with unit column stride (a view where t's layout allows, else a copy)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _launch_shape(n_cols: int, launch: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(rows per program, columns per program, warps). `launch`, a tuning knob, is (rows per program,
    warps) (launch_shape.program_shape); None: about _TILE values per program."""
    block_n = triton.next_power_of_2(n_cols)
    block_r = max(1, _TILE // block_n)
    block_r, num_warps = program_shape(launch, (block_r, 8 if block_r * block_n > _TILE else 4), "rows")
    return block_r, block_n, num_warps


# The gated norm's rows are single heads (128 wide), a few dozen in a decode step, tens of thousands in a
# prefill. Measured on an H200 (bench.norm_kernel): 2 warps and 8 heads per program from 2,048 tokens up
# (32 heads: 87 -> 71 us at 8,192 tokens), one head per program at one token (3.5 -> 1.5 us), where fewer
# programs than SMs would leave most of the GPU idle. Between, rows per program grow with the rows.
_GATED_TILE = 1024  # values per program at most: 8 heads of 128
_GATED_WARPS = 2
_GATED_ROWS_PER_GROUP = 1024  # about this many programs before a program takes a second row


def _gated_most_rows(head_dim: int) -> int:
    """The most heads a gated-norm program takes at this head size."""
    return max(1, _GATED_TILE // triton.next_power_of_2(head_dim))


def _gated_launch_shape(head_dim: int, num_rows: int, launch: tuple[int, int] | None) -> tuple[int, int, int]:
    """(rows per program, columns per program, warps) of the gated norm; `launch` as _launch_shape's."""
    block_d = triton.next_power_of_2(head_dim)
    most = _gated_most_rows(head_dim)
    grouped = max(1, num_rows // _GATED_ROWS_PER_GROUP)
    block_r = min(most, 1 << (grouped.bit_length() - 1))  # a power of two, 1 up to `most`
    block_r, num_warps = program_shape(launch, (block_r, _GATED_WARPS), "rows")
    return block_r, block_d, num_warps


def gated_launch_row_counts(head_dim: int) -> list[int]:
    """A row count (heads x tokens) for each program shape the gated norm launches at this head size,
    smallest first: the warm-up compiles every one, so that none is first met while serving."""
    counts, block_r = [], 1
    while block_r <= _gated_most_rows(head_dim):
        counts.append(block_r * _GATED_ROWS_PER_GROUP)
        block_r *= 2
    return counts


def _check_out(out: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    if out.shape != like.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(like.shape)}")
    return out


@triton.jit
def row_tile(num_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's BLOCK_R rows (int64) of a [num_rows, n_cols] problem, all BLOCK_N columns: (rows,
    cols, the column mask, the [BLOCK_R, BLOCK_N] mask of values inside the problem)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    return rows, cols, cmask, (rows < num_rows)[:, None] & cmask[None, :]


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    inner,
    n_cols,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    n_cols_f32,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    rows, cols, cmask, mask = row_tile(num_rows, n_cols, BLOCK_R, BLOCK_N)
    outer, sub = rows // inner, rows % inner
    x_off = (outer * stride_x_outer + sub * stride_x_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    o_off = rows[:, None] * n_cols + cols[None, :]  # outputs are contiguous [num_rows, n_cols]
    if HAS_RESIDUAL:
        r_off = (outer * stride_r_outer + sub * stride_r_inner)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        s = round_to(x + r, res_out_ptr.dtype.element_ty)  # the new residual, as stored
        tl.store(res_out_ptr + o_off, s, mask=mask)
        x = s.to(tl.float32)
    # Masked columns are 0 and add nothing to the sum of squares.
    var = tl.div_rn(tl.sum(x * x, axis=1), n_cols_f32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = 1.0 + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + o_off, round_to(y, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    launch: tuple[int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm over the last dim of x (any leading dims, rows may be strided). With
    `residual` (x's shape), first s = x + residual in their promoted dtype, and returns (normed, s).
    `out` / `residual_out`, when given, receive the results (contiguous, x's shape). `launch`: the
    program shape, (rows per program, warps); None: the module default."""
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"rms_norm weight has shape {tuple(weight.shape)}, expected ({n_cols},)")
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = _check_out(out, x, dtype, "out")
    x3 = _rows_view(x)
    if residual is None:
        r3, res_out = x3, out  # unread and unwritten (HAS_RESIDUAL is off)
    else:
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}")
        r3 = _rows_view(residual)
        res_out = _check_out(residual_out, x, dtype, "residual_out")
    num_rows = x3.shape[0] * x3.shape[1]
    block_r, block_n, num_warps = _launch_shape(n_cols, launch)
    if num_rows:
        _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x3,
            r3,
            weight,
            out,
            res_out,
            num_rows,
            x3.shape[1],
            n_cols,
            x3.stride(0),
            x3.stride(1),
            r3.stride(0),
            r3.stride(1),
            float(n_cols),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            num_warps=num_warps,
            **launch_options(x.device),
        )
    return out if residual is None else (out, res_out)


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    heads,
    head_dim,
    stride_x_tok,
    stride_x_head,
    stride_z_tok,
    stride_z_head,
    head_dim_f32,
    eps,
    PROD_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    rows, cols, cmask, mask = row_tile(num_rows, head_dim, BLOCK_R, BLOCK_D)
    tok, head = rows // heads, rows % heads
    x_raw = tl.load(
        x_ptr + (tok * stride_x_tok + head * stride_x_head)[:, None] + cols[None, :], mask=mask, other=0.0
    )
    x = x_raw.to(tl.float32)
    var = tl.div_rn(tl.sum(x * x, axis=1), head_dim_f32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    normed = round_to(x * rstd[:, None], x_raw.dtype)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = round_to(normed.to(tl.float32) * w[None, :], PROD_DTYPE)  # weight * normed, in torch's dtype
    z_off = (tok * stride_z_tok + head * stride_z_head)[:, None] + cols[None, :]
    z = tl.load(z_ptr + z_off, mask=mask, other=0.0).to(tl.float32)
    o = round_to(y.to(tl.float32) * silu_f32(z), out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * head_dim + cols[None, :], o, mask=mask)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x, z: [T, heads, D] (either may be a strided view with unit stride over D); weight: [D], plain (no
    +1). Per-head RMSNorm of x times weight, times silu(z); result [T, heads, D] in x's dtype. `launch`:
    the program shape, (rows per program, warps), a row being one head; None: the module default."""
    if x.dim() != 3 or z.shape != x.shape:
        raise ValueError(
            f"gated_rms_norm needs x and z of one [T, heads, D] shape, got {x.shape} and {z.shape}"
        )
    head_dim = x.shape[-1]
    if weight.shape != (head_dim,):
        raise ValueError(f"gated_rms_norm weight has shape {tuple(weight.shape)}, expected ({head_dim},)")
    out = _check_out(out, x, x.dtype, "out")
    x, z = _rows_view(x), _rows_view(z)
    num_rows = x.shape[0] * x.shape[1]
    block_r, block_d, num_warps = _gated_launch_shape(head_dim, num_rows, launch)
    if num_rows:
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x,
            z,
            weight,
            out,
            num_rows,
            x.shape[1],
            head_dim,
            x.stride(0),
            x.stride(1),
            z.stride(0),
            z.stride(1),
            float(head_dim),
            eps,
            PROD_DTYPE=TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)],
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            num_warps=num_warps,
            **launch_options(x.device),
        )
    return out
