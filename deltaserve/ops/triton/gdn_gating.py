"""The Gated DeltaNet gating of a prefill's rows in one kernel, on the GPU: g = -exp(A_log) *
softplus(a + dt_bias) in fp32 and beta = sigmoid(b) rounded to b's dtype, the inputs of fla's chunked
kernel. It replaces the torch reference's seven launches (deltaserve/ops/gdn.py: gdn_gating) per GDN
layer.

Same bits as the reference on CUDA: every step computes in fp32 what torch's CUDA kernels compute, with
the same libdevice functions (expf, log1pf), IEEE division and one rounding each where torch rounds:
exp(A_log) and its negation, a + dt_bias, softplus as torch's (x > 20: x; else log1p(exp(x))), their
product, and 1 / (1 + exp(-b)) rounded to b's dtype. The one exception is a subnormal result (a + dt_bias
below about -87): Triton links libdevice's flush-to-zero variants, so g is -0 where torch's is a
subnormal, a decay whose exp is 1 for both (and which fla's cumulative sums lose against any normal g).
Under Triton's CPU interpreter (no libdevice) exp and log1p come from numpy, within a few fp32 ulps of
torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.activation import _INTERPRETER, exp_f32, round_to
from deltaserve.ops.triton.norm import row_tile
from deltaserve.ops.triton.pdl import gdc_enter, launch_options

if not _INTERPRETER:
    from triton.language.extra import libdevice

# A program's tile: about 2048 (row, head) values, 16 per thread over 4 warps.
_TILE = 2048
_NUM_WARPS = 4


@triton.jit
def log1p_f32(x):
    """x: fp32. log(1 + x) as torch's CUDA kernels compute it (libdevice's log1pf)."""
    if _INTERPRETER:
        u = 1.0 + x  # log(u) * x / (u - 1): log1p within a few ulps where 1 + x rounds
        return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))
    else:
        return libdevice.log1p(x)


@triton.jit(do_not_specialize=["num_rows"])
def _gdn_gating_kernel(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    num_rows,
    heads,
    stride_a,
    stride_b,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    rows, cols, cmask, mask = row_tile(num_rows, heads, BLOCK_T, BLOCK_H)
    a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0)
    neg_decay = -exp_f32(tl.load(a_log_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
    x = a + tl.load(dt_bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    softplus = tl.where(x > 20.0, x, log1p_f32(exp_f32(x)))
    out = rows[:, None] * heads + cols[None, :]  # outputs are contiguous [num_rows, heads]
    tl.store(g_ptr + out, neg_decay[None, :] * softplus, mask=mask)
    beta = tl.div_rn(1.0, 1.0 + exp_f32(-b.to(tl.float32)))
    tl.store(beta_ptr + out, round_to(beta, beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, HV] (rows may be strided, as views of the fused in_proj output); A_log, dt_bias: [HV].
    Returns (g [T, HV] fp32, beta [T, HV] in b's dtype), both contiguous: deltaserve.ops.gdn.gdn_gating's
    results, bit for bit on CUDA."""
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(
            f"gdn_gating needs a and b of one [T, HV] shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    heads = a.shape[1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (heads,):
            raise ValueError(f"gdn_gating {name} has shape {tuple(t.shape)}, expected ({heads},)")
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    num_rows = a.shape[0]
    if num_rows:
        block_h = triton.next_power_of_2(heads)
        block_t = max(1, _TILE // block_h)
        _gdn_gating_kernel[(triton.cdiv(num_rows, block_t),)](
            a,
            b,
            A_log,
            dt_bias,
            g,
            beta,
            num_rows,
            heads,
            a.stride(0),
            b.stride(0),
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            num_warps=_NUM_WARPS,
            **launch_options(a.device),
        )
    return g, beta
