"""Top-k softmax routing of a Qwen3.5 MoE block on the GPU (the torch reference is `route` in
deltaserve/ops/moe.py): one kernel in place of softmax, top-k, the renormalising sum and division, and
the cast back to the logits' dtype.

`route(logits, k, renormalize)` -> (weights [T, k] in the logits' dtype, ids [T, k] int64), each row's
experts in descending probability, as torch.topk orders them. One program takes ROWS tokens:

* probabilities in fp32: exp(x - max) with libdevice's expf (torch's; Triton's tl.exp is ex2-based),
  divided by their sum with a round-to-nearest division. The sum's order differs from torch's, so a
  probability may differ from the reference's in the last fp32 bit;
* k rounds of argmax over the row, the chosen expert masked after each. An exact tie goes to the lower
  expert id (torch.topk leaves tie order unspecified); the chosen set is the reference's otherwise;
* renormalised (fp32 sum of the k, round-to-nearest division) and rounded once to the logits' dtype.

A row with a NaN logit gets NaN weights, as in the reference, and ids that are valid expert ids (the
expert kernels read weights by id and do not check them): such a row never faults the step.

Grids depend on shapes only and nothing is read back to the host: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.activation import exp_f32, round_to

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tokens per program: the [ROWS, E] tile stays at 4,096 values or fewer (16 per thread over 8 warps).
_TILE_VALUES = 4096
_NUM_WARPS = 8
# Below a full tile of tokens, one program per token: 256 experts on one warp (8 values a thread), where
# each of the k argmax rounds reduces with shuffles alone instead of across 8 warps through shared memory.
_ROW_VALUES_PER_WARP = 256


@triton.jit(do_not_specialize=["tokens"])  # no compile per batch size
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    tokens,
    num_experts,
    stride_lt,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BINS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < tokens
    experts = tl.arange(0, BINS)
    valid = row_ok[:, None] & (experts < num_experts)[None, :]
    x = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + experts[None, :],
        mask=valid,
        other=-float("inf"),
    ).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past the end: finite, never stored
    e = exp_f32(x - tl.max(x, axis=1)[:, None])
    probs = tl.div_rn(e, tl.sum(e, axis=1)[:, None])  # padding experts: exactly 0
    probs = tl.where(valid, probs, -1.0)  # below every probability: never chosen
    slots = tl.arange(0, K_PAD)
    top = tl.zeros((ROWS, K_PAD), dtype=tl.float32)
    top_ids = tl.zeros((ROWS, K_PAD), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # the lowest expert id holding the maximum; a row with NaN logits matches none: expert E - 1, so that
        # every id stays in range for the expert kernels (the row's output is NaN, as the reference's)
        best_id = tl.min(tl.where(probs == best[:, None], experts[None, :], BINS), axis=1)
        best_id = tl.minimum(best_id, num_experts - 1)
        top = tl.where(slots[None, :] == j, best[:, None], top)
        top_ids = tl.where(slots[None, :] == j, best_id.to(tl.int64)[:, None], top_ids)
        probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)
    if RENORMALIZE:
        top = tl.div_rn(top, tl.sum(top, axis=1)[:, None])  # slots past TOP_K hold 0
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    store = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, round_to(top, weights_ptr.dtype.element_ty), mask=store)
    tl.store(ids_ptr + out, top_ids, mask=store)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router logits (rows may be strided). Returns (weights [T, k] in the logits' dtype,
    ids [T, k] int64), as the torch reference."""
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}, expected 2-D (T, E)")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits has dtype {logits.dtype}, expected one of {', '.join(map(str, _DTYPES))}")
    tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    bins = triton.next_power_of_2(num_experts)
    rows = max(1, min(16, _TILE_VALUES // bins))
    warps = _NUM_WARPS
    if tokens < rows:  # decode rows: a program per token, its row over few warps (no partial tiles)
        rows, warps = 1, max(1, min(_NUM_WARPS, bins // _ROW_VALUES_PER_WARP))
    _route_kernel[(triton.cdiv(tokens, rows),)](
        logits,
        weights,
        ids,
        tokens,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        ROWS=rows,
        BINS=bins,
        num_warps=warps,
    )
    return weights, ids
