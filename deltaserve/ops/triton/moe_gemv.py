"""The routed experts of a Qwen3.5 MoE block at decode rows: one weight stream per routing slot, no
grouping (the torch reference is deltaserve/ops/moe.py; the grouped kernels are ops/triton/moe.py).

At a few tokens nearly every slot has an expert of its own, so grouping the slots by expert saves no
weight bytes; it costs three kernels and pads each expert's one row to a 16-row MMA tile, and its
gate_up grid is (used experts x I / 64) programs: 64 at the 35B-A3B's batch 1, under half the SMs of an
H100. Here two kernels stream the same bytes as GEMVs:

1. `_slots_gate_up_kernel`, grid (T*k, cdiv(I, BLOCK_N)): slot s = t * k + j reads expert e = ids[s]'s
   gate and up rows of its BLOCK_N block against x[t], and writes silu(gate) * up to `inter[s]`.
2. `_slots_down_kernel`, grid (T, cdiv(H, BLOCK_N)): token t's BLOCK_N output columns, over its k slots
   in order: w2[e] @ inter[s], times the slot's routing weight, summed in fp32 and rounded once. With the
   block's shared expert already run (`SharedExpertOutput`), it then adds shared * sigmoid(x @ gate),
   which otherwise takes a GEMV of one row and three elementwise kernels.
The K loops and the slot loop are unrolled over the model's constants (k, H, I), so a program's weight
tiles can all be in flight at once.

Numerics are the grouped kernels' (and so the reference's up to the order of the dot products' sums):
products and sums in fp32; the gate and up results rounded, silu(gate) rounded, times up rounded; the
down result rounded, times the weight rounded; the k per-slot results summed in fp32 and rounded once
(the reference's rounding after each add is the same for k <= 2, within a rounding of it otherwise).
The shared expert's share rounds where torch rounds it: the gate logit (a linear's output, its dot
summed in another order), its sigmoid, the product, the sum.

Grids depend on (T, k, H, I) only and nothing is read back to the host: CUDA-graph capturable. ids must
lie in [0, E) (not checked: checking would synchronise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.activation import _INTERPRETER, mul_f32, round_to, sigmoid_f32, silu_f32
from deltaserve.ops.triton.moe import check_inputs, output_for
from deltaserve.ops.triton.pdl import gdc_enter, launch_options


@dataclass(frozen=True, slots=True)
class SharedExpertOutput:
    """A Qwen3.5 MoE block's shared expert, already run: its output [T, H] and its sigmoid gate's weight
    row [H] (the block adds out * sigmoid(x @ gate) to the routed sum)."""

    out: torch.Tensor
    gate: torch.Tensor

    def check(self, x: torch.Tensor) -> None:
        """Raises ValueError naming the field where it does not fit x [T, H]."""
        tokens, hidden = x.shape
        if self.out.shape != x.shape or self.out.dtype != x.dtype or self.out.stride(1) != 1:
            raise ValueError(
                f"shared.out must be ({tokens}, {hidden}) {x.dtype} with unit column stride, got "
                f"{tuple(self.out.shape)} {self.out.dtype} strides {self.out.stride()}"
            )
        if self.gate.shape != (hidden,) or self.gate.dtype != x.dtype or self.gate.stride(0) != 1:
            raise ValueError(
                f"shared.gate must be a contiguous ({hidden},) {x.dtype} row, got {tuple(self.gate.shape)} "
                f"{self.gate.dtype}"
            )
        for name, t in (("shared.out", self.out), ("shared.gate", self.gate)):
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")


# (BLOCK_N, BLOCK_K, warps), autotuned per shape like the dense GEMV (ops/triton/linear.py).
_CONFIGS = [(4, 512, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8)]
_INTERPRETER_BLOCKS = (8, 32)


@triton.jit
def _slots_gate_up_kernel(
    x_ptr,
    w13_ptr,
    ids_ptr,
    inter_ptr,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wk,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # The K loop is unrolled (HIDDEN is a constant of the model), so every weight tile's load can be
    # in flight at once: a program's whole share of the stream, not one tile at a time.
    gdc_enter(USE_GDC)
    slot = tl.program_id(0)
    token = slot // TOP_K
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < INTER
    gate_rows = w13_ptr + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    x_row = x_ptr + token.to(tl.int64) * stride_xt
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < HIDDEN
        tile_ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_row + cols * stride_xh, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        w_gate = tl.load(gate_rows + cols[None, :] * stride_wk, mask=tile_ok, other=0.0).to(tl.float32)
        w_up = tl.load(up_rows + cols[None, :] * stride_wk, mask=tile_ok, other=0.0).to(tl.float32)
        acc_gate += w_gate * x
        acc_up += w_up * x
    dtype = inter_ptr.dtype.element_ty
    gate = round_to(tl.sum(acc_gate, axis=1), dtype).to(tl.float32)
    up = round_to(tl.sum(acc_up, axis=1), dtype).to(tl.float32)
    act = round_to(silu_f32(gate), dtype).to(tl.float32)
    tl.store(inter_ptr + slot.to(tl.int64) * INTER + rows, round_to(act * up, dtype), mask=row_ok)


@triton.jit
def _slots_down_kernel(
    inter_ptr,
    w2_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    x_ptr,
    shared_ptr,
    shared_gate_ptr,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_xt,
    stride_xh,
    stride_st,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # The slots and the K loop are unrolled (TOP_K and INTER are constants of the model), so the k
    # experts' weight tiles can all be in flight at once; the sum over slots keeps slot order.
    gdc_enter(USE_GDC)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < HIDDEN
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        weight = tl.load(weights_ptr + slot).to(tl.float32)
        w_rows = w2_ptr + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn
        inter_row = inter_ptr + slot.to(tl.int64) * INTER
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, INTER, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < INTER
            h = tl.load(inter_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_rows + cols[None, :] * stride_wk, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * h
        down = round_to(tl.sum(acc, axis=1), dtype).to(tl.float32)
        total += round_to(down * weight, dtype).to(tl.float32)
    result = round_to(total, dtype)
    if SHARED:
        # + shared * sigmoid(x . shared_gate), rounded where the unfused ops round: the gate logit (a
        # linear's output), its sigmoid, the product, the sum. Each program computes the logit itself.
        x_row = x_ptr + token.to(tl.int64) * stride_xt
        acc_gate = tl.zeros([BLOCK_K], dtype=tl.float32)
        for h0 in tl.static_range(0, HIDDEN, BLOCK_K):
            cols = h0 + tl.arange(0, BLOCK_K)
            col_ok = cols < HIDDEN
            xs = tl.load(x_row + cols * stride_xh, mask=col_ok, other=0.0).to(tl.float32)
            acc_gate += xs * tl.load(shared_gate_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        logit = round_to(tl.sum(acc_gate, axis=0), dtype).to(tl.float32)
        scale = round_to(sigmoid_f32(logit), dtype).to(tl.float32)
        shared = tl.load(shared_ptr + token.to(tl.int64) * stride_st + rows, mask=row_ok, other=0.0)
        gated = round_to(mul_f32(shared.to(tl.float32), scale), dtype).to(tl.float32)
        result = round_to(result.to(tl.float32) + gated, dtype)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + rows, result, mask=row_ok)


def _tuned(kernel, key: list[str]):
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in _CONFIGS]
    # The winners persist in Triton's cache directory: a restart does not re-tune.
    return triton.autotune(configs=configs, key=key, cache_results=True)(kernel)


_gate_up_tuned = _tuned(_slots_gate_up_kernel, ["TOP_K", "HIDDEN", "INTER"])
_down_tuned = _tuned(_slots_down_kernel, ["TOP_K", "HIDDEN", "INTER", "SHARED"])


def slot_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    shared: SharedExpertOutput | None = None,
) -> torch.Tensor:
    """`ops.triton.moe.fused_experts`'s contract (same arguments, same result up to the dot products'
    summation order), streaming each routing slot's expert as a GEMV: for a few tokens (decode rows).
    With `shared`, the MoE block's whole output: the routed sum + shared.out * sigmoid(x @ shared.gate),
    rounded as those ops round. Never synchronises with the host: CUDA-graph capturable."""
    check_inputs(x, w13, w2, weights, ids)
    tokens, hidden = x.shape
    inter_size, top_k = w13.shape[1] // 2, ids.shape[1]
    if shared is not None:
        shared.check(x)
    out = output_for(x, out)
    if tokens == 0 or hidden == 0:
        return out
    ids = ids.contiguous()
    weights = weights.contiguous()
    inter = torch.empty(tokens * top_k, inter_size, dtype=x.dtype, device=x.device)
    shared_out, shared_gate = (x, x) if shared is None else (shared.out, shared.gate)
    model = dict(TOP_K=top_k, HIDDEN=hidden, INTER=inter_size, **launch_options(x.device))
    gate_up_args = (x, w13, ids, inter, *x.stride(), *w13.stride())
    down_args = (inter, w2, ids, weights, out, x, shared_out, shared_gate, *w2.stride(), out.stride(0))
    down_args += (*x.stride(), shared_out.stride(0))
    shared_flag = dict(SHARED=shared is not None)
    if _INTERPRETER:
        block_n, block_k = _INTERPRETER_BLOCKS
        blocks = dict(BLOCK_N=block_n, BLOCK_K=block_k)
        _slots_gate_up_kernel[(tokens * top_k, triton.cdiv(inter_size, block_n))](
            *gate_up_args, **model, **blocks
        )
        _slots_down_kernel[(tokens, triton.cdiv(hidden, block_n))](
            *down_args, **model, **shared_flag, **blocks
        )
        return out
    _gate_up_tuned[lambda meta: (tokens * top_k, triton.cdiv(inter_size, meta["BLOCK_N"]))](
        *gate_up_args, **model
    )
    _down_tuned[lambda meta: (tokens, triton.cdiv(hidden, meta["BLOCK_N"]))](
        *down_args, **model, **shared_flag
    )
    return out
