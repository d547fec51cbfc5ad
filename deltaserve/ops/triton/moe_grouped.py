"""The routed experts of a Qwen3.5 MoE block through torch's grouped GEMM, for large steps.

`grouped_experts(x, w13, w2, weights, ids)` computes what `deltaserve.ops.triton.moe.fused_experts`
computes (same formula, same roundings), with the two expert GEMMs done by `torch.nn.functional.grouped_mm`
(on Hopper, CUTLASS's grouped GEMM: TMA loads and warp-specialised pipelines, which the Triton kernels'
gathered loads cannot use). Four steps, none reading a value back to the host (CUDA-graph capturable):

1. Grouping: the shared grouping kernels with one-row blocks (`group_slots(ids, E, 1)`), so that the
   slots are ordered by expert without padding and `block_end` holds each expert's end row, the grouped
   GEMM's offsets.
2. The routed rows: a[i] = x[sorted_slots[i] // k] ([T*k, H], one gathered copy of x per slot).
3. gate | up = grouped_mm(a, w13^T) (rounded to x's dtype, as F.linear's output), silu_and_mul (the
   Triton kernel, rounding as the reference), down = grouped_mm(inter, w2^T) (rounded).
4. `_combine_sorted_kernel`, grid (T, cdiv(H, BLOCK_H)): out[t] = the fp32 sum over j of
   round(down[position[t*k + j]] * weights[t, j]), rounded once; position is the inverse of the
   grouping's permutation. No atomics: deterministic.

The GEMMs accumulate in fp32 like the Triton kernels, in a different order, so the two paths agree to
within a rounding of the GEMM outputs, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaserve.ops.triton.activation import round_to, silu_and_mul
from deltaserve.ops.triton.moe import check_inputs, group_slots, output_for

# torch >= 2.9 has the public name; older releases only the private op.
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

_BLOCK_H = 1024  # one token row's columns per combine program (8 values per thread over 4 warps)
_COMBINE_WARPS = 4


def grouped_gemm_supported(x: torch.Tensor) -> bool:
    """True where torch's grouped GEMM serves x: bf16, on the CPU (torch's reference loop, for tests) or
    a CUDA GPU of compute capability 9.0+ (the CUTLASS kernel)."""
    if _grouped_mm is None or x.dtype != torch.bfloat16:
        return False
    if x.device.type == "cpu":
        return True
    return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (9, 0)


@triton.jit
def _combine_sorted_kernel(
    down_ptr, position_ptr, weights_ptr, out_ptr, top_k, hidden, stride_ot, BLOCK_H: tl.constexpr
):
    """out[t] = the fp32 sum over j < k of round(down[position[t*k + j]] * weights[t*k + j]), rounded."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(top_k):
        slot = token * top_k + j
        row = tl.load(position_ptr + slot).to(tl.int64)
        weight = tl.load(weights_ptr + slot).to(tl.float32)
        down = tl.load(down_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        acc += round_to(down * weight, dtype).to(tl.float32)  # the reference multiplies in x's dtype
    tl.store(out_ptr + token * stride_ot + cols, round_to(acc, dtype), mask=mask)


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The arguments and result of `deltaserve.ops.triton.moe.fused_experts` (x: [T, H]; w13: [E, 2I, H];
    w2: [E, H, I]; weights, ids: [T, k]); x must be bf16 where `grouped_gemm_supported(x)`. Never
    synchronises with the host."""
    check_inputs(x, w13, w2, weights, ids)
    if not grouped_gemm_supported(x):
        raise ValueError(
            f"x is {x.dtype} on {x.device}: the grouped GEMM needs torch.bfloat16 on the CPU or a GPU of "
            "compute capability 9.0 or newer"
        )
    tokens, hidden = x.shape
    num_experts = w13.shape[0]
    top_k = ids.shape[1]
    out = output_for(x, out)
    if tokens == 0 or hidden == 0:
        return out
    grouping = group_slots(ids, num_experts, block_m=1)
    order = grouping.sorted_slots  # [T*k]: with one-row blocks there is no padding
    rows = x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))
    gate_up = _grouped_mm(rows, w13.transpose(1, 2), offs=grouping.block_end)
    down = _grouped_mm(silu_and_mul(gate_up), w2.transpose(1, 2), offs=grouping.block_end)
    position = torch.empty_like(order)
    position.scatter_(0, order.long(), torch.arange(order.numel(), dtype=order.dtype, device=x.device))
    _combine_sorted_kernel[(tokens, triton.cdiv(hidden, _BLOCK_H))](
        down,
        position,
        weights.reshape(-1),
        out,
        top_k,
        hidden,
        out.stride(0),
        BLOCK_H=_BLOCK_H,
        num_warps=_COMBINE_WARPS,
    )
    return out
