"""The routed experts of a Qwen3.5 MoE block on the GPU (the torch reference is deltaserve/ops/moe.py).

`fused_experts(x, w13, w2, weights, ids)`: out[t] = sum over the k routing slots j of token t of
weights[t, j] * w2[e] @ (silu(gate) * up), with e = ids[t, j] and gate | up = w13[e] @ x[t].
A slot is one (token, j) pair, numbered s = t * k + j (ids and weights flattened). Three steps:

1. Grouping (`group_slots`, three kernels). The slots are ordered by expert (stably: ascending slots
   within an expert) and laid out in `sorted_slots`, each expert's run padded up to a multiple of
   BLOCK_M with the sentinel T*k: every BLOCK_M block belongs to one expert, `block_expert[b]`, which is
   E for the blocks past the last used one (their rows all hold the sentinel). The layout has the
   shape-only length T*k + min(E, T*k) * (BLOCK_M - 1): at most min(E, T*k) experts are used and each
   pads by fewer than BLOCK_M rows. `_chunk_histogram_kernel` counts each chunk's slots per expert;
   `_layout_kernel` (one program) turns the counts into each chunk's offset within every expert's run
   and each expert's padded start and block end; `_scatter_kernel` places each chunk's slots (offset +
   rank among the chunk's earlier slots of that expert) and writes `block_expert` and the sentinels.
2. `_gate_up_kernel`, grid (blocks * cdiv(I, BLOCK_N),): a block's x rows (gathered as slot // k) times
   w13[e]^T, the gate and up columns of the tile in two accumulators; the epilogue writes
   silu(gate) * up to `inter` at the rows' padded positions.
3. `_down_kernel`, grid (blocks * cdiv(H, BLOCK_N),): a block's `inter` rows times w2[e]^T, times the
   routing weight, scattered to `per_slot[s]` ([T*k, H]); `_combine_kernel`, grid (T, cdiv(H, BLOCK_H)),
   sums each token's k rows in fp32 and rounds once. No atomics: the result is deterministic.
In both GEMMs a block's column tiles are consecutive program ids, so they run at the same time and read
the block's rows from L2 after the first (with the blocks outermost, a block's rows came back from HBM
once per column tile: 8 times for gate_up, 32 times for down at the 35B-A3B's 64-column tiles), and an
expert's blocks are adjacent, so they share its weight tiles the same way.

Every grid is a function of the shapes (T, k, E, H, I) only and nothing is read back to the host:
programs of unused blocks read block_expert == E and return, padding rows (sentinel slots) are masked.
The call can be captured in a CUDA graph and replayed with new ids / weights (same shapes). Every slot
appears exactly once in `sorted_slots`, so every row of `per_slot` is written. ids must lie in [0, E):
that is not checked, as checking would synchronise.

Numerics follow the reference in x's dtype, rounding where it rounds (all products accumulate in fp32):
the gate and up GEMM results are rounded (F.linear's output), silu(gate) is rounded, times up rounded
(silu_and_mul); the down GEMM result is rounded, times the weight rounded (the reference multiplies in
x's dtype). The reference adds the k per-slot results to a zero row one expert at a time, rounding after
each add; here they are summed in fp32 and rounded once, which is the same for k <= 2 and within a
rounding of it otherwise. fp32 inputs use IEEE dots (no TF32), as torch's fp32 matmul does by default.
Narrowing casts go through `round_to` (the interpreter truncates fp32 -> bf16), dots through `_dot`
(the interpreter multiplies bf16 tiles as raw bits, so there it dots fp32 copies).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deltaserve.ops.triton.activation import round_to, silu_f32
from deltaserve.ops.triton.attention import _dot

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int64, torch.int32)


class MoeTiles(NamedTuple):
    """Fixed launch parameters of the two grouped GEMMs (no autotuning: nothing benchmarks while serving;
    `python3 -m deltaserve.bench.moe_kernel` sweeps them offline)."""

    block_m: int  # (token, slot) rows per block; one expert per block
    block_n: int  # output columns per program (I for gate_up, each for gate and up; H for down)
    block_k: int  # reduction step (H for gate_up, I for down)
    num_warps: int
    num_stages: int


# 16-bit inputs, by the rows an expert averages (T*k / E):
# * at most 16 (decode and small batches): BLOCK_M = 16, the smallest tl.dot M, so that the padding of the
#   few used experts costs little. These calls stream each used expert's weights and are memory-bound.
# * above 16, under 128: BLOCK_M = 64 reuses every weight tile across 64 rows.
# * 128 and more (large prefill steps): 128 x 128 tiles over 8 warps, 1.17x the 64 x 64 tiles at T = 8192
#   on the 35B-A3B's experts (279 vs 239 TFLOP/s on an H200, `python3 -m deltaserve.bench.moe_kernel`,
#   docs/benchmarks/2026-12-02-h200-moe-tiles.md). Below 128 rows the sweep's rankings did not repeat
#   from one run to the next, so the former tiles stay.
# gate_up's stage is (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes: 18 to 48 KiB, 3 stages within any
# recent GPU's shared memory. fp32 inputs (tests) halve BLOCK_K to keep the same bytes per stage, and stop
# at 64-row tiles.
_SMALL_BATCH_BLOCK_M = 16
_LARGE_TILES_FROM = 128  # rows per expert
_TILES_SMALL = MoeTiles(16, 64, 64, 4, 3)
_TILES_MEDIUM = MoeTiles(64, 64, 64, 4, 3)
_TILES_LARGE = MoeTiles(128, 128, 64, 8, 3)
_TILES_FP32_SMALL = MoeTiles(16, 64, 32, 4, 3)
_TILES_FP32_LARGE = MoeTiles(64, 64, 32, 4, 3)
# The combine kernel: one token row's BLOCK_H columns per program (8 values per thread over 4 warps).
_BLOCK_H = 1024
_COMBINE_WARPS = 4


def default_tiles(tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """The launch parameters `fused_experts` uses unless given others: a function of shapes and dtype
    only (graph-capture safe)."""
    slots = tokens * top_k
    small = slots <= _SMALL_BATCH_BLOCK_M * num_experts
    if dtype == torch.float32:
        return _TILES_FP32_SMALL if small else _TILES_FP32_LARGE
    if small:
        return _TILES_SMALL
    return _TILES_MEDIUM if slots < _LARGE_TILES_FROM * num_experts else _TILES_LARGE


def check_tiles(tiles: MoeTiles) -> None:
    """Raises ValueError naming the field when `tiles` cannot launch the kernels."""
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(tiles, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"tiles.{name} must be a power of two >= 16 (a tl.dot dimension), got {value}")
    if tiles.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"tiles.num_warps must be 1, 2, 4, 8 or 16, got {tiles.num_warps}")
    if tiles.num_stages < 1:
        raise ValueError(f"tiles.num_stages must be >= 1, got {tiles.num_stages}")


def parse_tiles(variable: str, text: str) -> MoeTiles:
    """A setting of launch parameters, "block_m,block_n,block_k,num_warps,num_stages"; ValueError naming
    the variable, the expected form and the value otherwise."""
    try:
        tiles = MoeTiles(*(int(part) for part in text.split(",")))
    except (TypeError, ValueError):
        raise ValueError(
            f"{variable} must be five integers block_m,block_n,block_k,num_warps,num_stages, got {text!r}"
        ) from None
    try:
        check_tiles(tiles)
    except ValueError as error:
        raise ValueError(f"{variable}={text!r}: {error}") from None
    return tiles


# DELTASERVE_MOE_LARGE_TILES="m,n,k,warps,stages": the 16-bit launch parameters from _LARGE_TILES_FROM rows
# per expert, for an A/B over HTTP of a `bench.moe_kernel` candidate (e.g. 256,64,64,8,3: one block per
# expert at the 35B-A3B's 4,608-token step); unset, the 128 x 128 tiles above.
if os.environ.get("DELTASERVE_MOE_LARGE_TILES"):
    _TILES_LARGE = parse_tiles("DELTASERVE_MOE_LARGE_TILES", os.environ["DELTASERVE_MOE_LARGE_TILES"])


# The grouping's kernels (step 1): their grids depend on T*k only.
_GROUP_CHUNK = 128  # slots per program of the histogram and scatter kernels
_SCAN_ROWS = 32  # chunk rows per step of the single-program scan
_BLOCKS_PER_STEP = 32  # blocks per step of a scatter program's block layout


class Grouping(NamedTuple):
    """The slots grouped by expert in BLOCK_M blocks; both lengths depend on shapes only."""

    sorted_slots: torch.Tensor  # [blocks * BLOCK_M] int32: the slot at each padded position; T*k = padding
    block_expert: torch.Tensor  # [blocks] int32: each block's expert; E for blocks past the last used one
    block_end: torch.Tensor  # [E] int32: one past each expert's last block (with BLOCK_M = 1: its last row)


def _max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the used blocks: each of the at most min(E, T*k) used experts pads < BLOCK_M rows."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m)


@triton.jit(do_not_specialize=["num_slots"])
def _chunk_histogram_kernel(ids_ptr, hist_ptr, num_slots, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """hist[c, e] = the slots of chunk c routed to expert e."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_slots
    experts = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    bins = tl.arange(0, BINS)
    past_the_end = CHUNK - tl.sum(valid.to(tl.int32), axis=0)  # counted in bin 0 above
    counts = tl.histogram(experts, BINS) - tl.where(bins == 0, past_the_end, 0)
    tl.store(hist_ptr + chunk * BINS + bins, counts)


@triton.jit(do_not_specialize=["num_chunks"])
def _layout_kernel(
    hist_ptr,
    layout_ptr,
    num_chunks,
    num_experts,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One program. hist[c, e] becomes the slots of expert e in the chunks before c (in place);
    layout = [counts | pad_start | block_end] per expert: its slots, its first padded position, one past
    its last block (non-decreasing)."""
    bins = tl.arange(0, BINS)
    running = tl.zeros([BINS], dtype=tl.int32)
    for row0 in range(0, num_chunks, ROWS):
        rows = row0 + tl.arange(0, ROWS)
        ptrs = hist_ptr + rows[:, None] * BINS + bins[None, :]
        in_range = (rows < num_chunks)[:, None]
        counts = tl.load(ptrs, mask=in_range, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + running[None, :], mask=in_range)
        running += tl.sum(counts, axis=0)
    counts = tl.where(bins < num_experts, running, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    tl.store(layout_ptr + bins, counts)
    tl.store(layout_ptr + BINS + bins, (block_end - blocks) * BLOCK_M)
    tl.store(layout_ptr + 2 * BINS + bins, block_end)


@triton.jit(do_not_specialize=["num_slots", "num_blocks", "blocks_per_program"])
def _scatter_kernel(
    ids_ptr,
    hist_ptr,
    layout_ptr,
    sorted_slots_ptr,
    block_expert_ptr,
    num_slots,
    num_experts,
    num_blocks,
    blocks_per_program,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BINS: tl.constexpr,
    BLOCKS_PER_STEP: tl.constexpr,
):
    """Chunk c's slots to their padded positions (ascending within an expert: its earlier chunks' slots,
    then the chunk's earlier slots of that expert come first); then block_expert and the padding sentinel
    of this program's share of the blocks. The two write disjoint positions."""
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + lane
    valid = offs < num_slots
    experts = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    same_before = (experts[None, :] == experts[:, None]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    start = tl.load(layout_ptr + BINS + experts, mask=valid, other=0)
    earlier = tl.load(hist_ptr + chunk * BINS + experts, mask=valid, other=0)
    tl.store(sorted_slots_ptr + start + earlier + rank, offs, mask=valid)

    bins = tl.arange(0, BINS)
    block_end = tl.load(layout_ptr + 2 * BINS + bins)
    is_expert = bins < num_experts
    first = chunk * blocks_per_program
    last = tl.minimum(first + blocks_per_program, num_blocks)
    for block0 in range(first, last, BLOCKS_PER_STEP):
        blocks = block0 + tl.arange(0, BLOCKS_PER_STEP)
        mine = blocks < last
        ended = (block_end[None, :] <= blocks[:, None]) & is_expert[None, :]
        expert = tl.sum(ended.to(tl.int32), axis=1)  # E past the last used block
        tl.store(block_expert_ptr + blocks, expert, mask=mine)
        used = mine & (expert < num_experts)
        count = tl.load(layout_ptr + expert, mask=used, other=0)
        pad_start = tl.load(layout_ptr + BINS + expert, mask=used, other=0)
        positions = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        padding = positions - pad_start[:, None] >= count[:, None]  # every row of an unused block
        tl.store(sorted_slots_ptr + positions, num_slots, mask=mine[:, None] & padding)


def group_slots(ids: torch.Tensor, num_experts: int, block_m: int) -> Grouping:
    """ids: [T, k] expert ids in [0, E). Three kernels; no value reaches the host."""
    flat = ids.reshape(-1)
    num_slots = flat.numel()
    device = flat.device
    num_blocks = _max_blocks(num_slots, num_experts, block_m)
    num_chunks = triton.cdiv(num_slots, _GROUP_CHUNK)
    bins = triton.next_power_of_2(num_experts)
    hist = torch.empty(num_chunks, bins, dtype=torch.int32, device=device)
    layout = torch.empty(3, bins, dtype=torch.int32, device=device)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    _chunk_histogram_kernel[(num_chunks,)](flat, hist, num_slots, CHUNK=_GROUP_CHUNK, BINS=bins)
    _layout_kernel[(1,)](hist, layout, num_chunks, num_experts, BLOCK_M=block_m, BINS=bins, ROWS=_SCAN_ROWS)
    _scatter_kernel[(num_chunks,)](
        flat,
        hist,
        layout,
        sorted_slots,
        block_expert,
        num_slots,
        num_experts,
        num_blocks,
        triton.cdiv(num_blocks, num_chunks),
        BLOCK_M=block_m,
        CHUNK=_GROUP_CHUNK,
        BINS=bins,
        BLOCKS_PER_STEP=_BLOCKS_PER_STEP,
    )
    return Grouping(sorted_slots, block_expert, layout[2, :num_experts])


@triton.jit(do_not_specialize=["num_slots"])  # T*k: no compile per batch size
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    inter_ptr,
    sorted_slots_ptr,
    block_expert_ptr,
    num_slots,
    top_k,
    hidden,
    inter_size,
    num_experts,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):
    """inter[p, n] = silu(gate) * up for the padded positions p of one block and BLOCK_N columns n < I.
    With DESCRIPTORS, w13_ptr is a tensor descriptor over w13 as [E * 2I, H] with [BLOCK_N, BLOCK_K]
    blocks (I a multiple of BLOCK_N, so a gate tile never reaches into the up rows)."""
    num_col_tiles = tl.cdiv(inter_size, BLOCK_N)
    block = tl.program_id(0) // num_col_tiles  # a block's column tiles are consecutive programs
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:  # past the last used block
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # padded positions
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots  # False on padding rows (their token index is out of range)
    tokens = (slots // top_k).to(tl.int64)
    cols = (tl.program_id(0) % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xt
    if DESCRIPTORS:
        gate_row = expert * 2 * inter_size + (tl.program_id(0) % num_col_tiles) * BLOCK_N
    else:
        w = w13_ptr + expert.to(tl.int64) * stride_we
        gate_cols = w + cols[None, :] * stride_wn  # w13[e, n, :] is gate row n, w13[e, I + n, :] up row n
        up_cols = w + (cols[None, :] + inter_size) * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < hidden
        a = tl.load(x_rows + ks[None, :] * stride_xh, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if DESCRIPTORS:  # the K tail past H reads as zeros
            w_gate = w13_ptr.load([gate_row, k0]).T  # [BLOCK_K, BLOCK_N]
            w_up = w13_ptr.load([gate_row + inter_size, k0]).T
        else:
            w_mask = k_ok[:, None] & col_ok[None, :]  # [BLOCK_K, BLOCK_N] tiles
            w_gate = tl.load(gate_cols + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
            w_up = tl.load(up_cols + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        acc_gate += _dot(a, w_gate, DOT_PRECISION)
        acc_up += _dot(a, w_up, DOT_PRECISION)
    dtype = inter_ptr.dtype.element_ty
    gate = round_to(acc_gate, dtype).to(tl.float32)  # F.linear's rounded output
    up = round_to(acc_up, dtype).to(tl.float32)
    act = round_to(silu_f32(gate), dtype).to(tl.float32)  # rounded, as F.silu(gate) is
    out = inter_ptr + rows.to(tl.int64)[:, None] * inter_size + cols[None, :]
    tl.store(out, round_to(act * up, dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    inter_ptr,
    w2_ptr,
    weights_ptr,
    per_slot_ptr,
    sorted_slots_ptr,
    block_expert_ptr,
    num_slots,
    hidden,
    inter_size,
    num_experts,
    stride_we,
    stride_wn,
    stride_wi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):
    """per_slot[s, n] = weight[s] * (inter[p] @ w2[e, n, :]) for the slots s of one block (at padded
    positions p) and BLOCK_N columns n < H. With DESCRIPTORS, inter_ptr and w2_ptr are tensor descriptors
    over inter ([BLOCK_M, BLOCK_K] blocks) and w2 as [E * H, I] ([BLOCK_N, BLOCK_K] blocks; H a multiple
    of BLOCK_N): padding rows then read unwritten `inter` rows, whose results the store masks."""
    num_col_tiles = tl.cdiv(hidden, BLOCK_N)
    block = tl.program_id(0) // num_col_tiles
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:  # past the last used block
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # padded positions
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    cols = (tl.program_id(0) % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    offs_k = tl.arange(0, BLOCK_K)
    if DESCRIPTORS:
        w_row = expert * hidden + (tl.program_id(0) % num_col_tiles) * BLOCK_N
    else:
        a_rows = inter_ptr + rows.to(tl.int64)[:, None] * inter_size
        w_cols = w2_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        if DESCRIPTORS:  # the K tail past I reads as zeros
            a = inter_ptr.load([block * BLOCK_M, k0])
            w = w2_ptr.load([w_row, k0]).T
        else:
            ks = k0 + offs_k
            k_ok = ks < inter_size
            a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, w, DOT_PRECISION)
    dtype = per_slot_ptr.dtype.element_ty
    down = round_to(acc, dtype).to(tl.float32)  # F.linear's rounded output
    weight = tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)
    out = per_slot_ptr + slots.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(out, round_to(down * weight[:, None], dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(per_slot_ptr, out_ptr, top_k, hidden, stride_ot, BLOCK_H: tl.constexpr):
    """out[t] = the fp32 sum of per_slot[t * k : (t + 1) * k], rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(top_k):
        row = per_slot_ptr + (token * top_k + j) * hidden
        acc += tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, round_to(acc, out_ptr.dtype.element_ty), mask=mask)


def check_inputs(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected 2-D (T, H)")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x has dtype {x.dtype}, expected one of {', '.join(map(str, _DTYPES))}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[1] == 0 or w13.shape[2] != hidden:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}, expected (E, 2 * I, {hidden}) with I >= 1")
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden, inter_size):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}, expected ({num_experts}, {hidden}, {inter_size})")
    if weights.dim() != 2 or weights.shape[0] != tokens or not 1 <= weights.shape[1] <= num_experts:
        raise ValueError(
            f"weights has shape {tuple(weights.shape)}, expected ({tokens}, k), 1 <= k <= {num_experts}"
        )
    if ids.shape != weights.shape:
        raise ValueError(f"ids has shape {tuple(ids.shape)}, expected weights' {tuple(weights.shape)}")
    for name, t in (("w13", w13), ("w2", w2), ("weights", weights)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected x's {x.dtype}")
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"ids has dtype {ids.dtype}, expected torch.int64 or torch.int32")
    for name, t in (("w13", w13), ("w2", w2), ("weights", weights), ("ids", ids)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")


def output_for(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked to be a contiguous tensor of x's shape and dtype, or a new one."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}, "
            f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (strided)'}"
        )
    return out


def _launch(tiles: MoeTiles, precision: str, descriptors: bool) -> dict[str, int | str | bool]:
    return dict(
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION=precision,
        DESCRIPTORS=descriptors,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def descriptors_refusal(
    w13: torch.Tensor, w2: torch.Tensor, tiles: MoeTiles, down_tiles: MoeTiles
) -> str | None:
    """What stops the weights from being read through tensor descriptors (TMA), or None: a gate tile
    must not reach into the up rows, nor a down tile into the next expert's rows, and a descriptor needs
    contiguous rows."""
    hidden, inter_size = w2.shape[1], w2.shape[2]
    if inter_size % tiles.block_n:
        return f"descriptors need the expert size ({inter_size}) to be a multiple of tiles.block_n ({tiles.block_n})"
    if hidden % down_tiles.block_n:
        return (
            f"descriptors need the hidden size ({hidden}) to be a multiple of down_tiles.block_n "
            f"({down_tiles.block_n})"
        )
    for name, t in (("w13", w13), ("w2", w2)):
        if not t.is_contiguous():
            return f"descriptors need a contiguous {name}, got strides {t.stride()}"
    return None


def descriptors_fit(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the default tiles of this call can read the weights through descriptors on x's device
    (shapes and the device only: graph-capture safe)."""
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    tiles = default_tiles(x.shape[0], ids.shape[1], w13.shape[0], x.dtype)
    return descriptors_refusal(w13, w2, tiles, tiles) is None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[E, N, K] as [E * N, K]: one expert's rows after the other's."""
    return t.reshape(-1, t.shape[-1])


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    tiles: MoeTiles | None = None,
    down_tiles: MoeTiles | None = None,
    descriptors: bool = False,
) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; weights: [T, k] in x's dtype;
    ids: [T, k] int64 (or int32) expert ids in [0, E). Sum over each token's experts of
    weight * down(silu(gate x) * up x): [T, H] in x's dtype, written into `out` when given (contiguous).
    `tiles`: launch parameters other than `default_tiles` (benchmarks); `down_tiles`: the down kernel's
    own, with the same block_m (default: `tiles`). `descriptors`: the expert weights and down's `inter`
    rows are read through TMA tensor descriptors instead of pointers (same results; ValueError with
    `descriptors_refusal`'s reason where they cannot be). Never synchronises with the host: CUDA-graph capturable (module
    docstring)."""
    check_inputs(x, w13, w2, weights, ids)
    for given in (tiles, down_tiles):
        if given is not None:
            check_tiles(given)
    tokens, hidden = x.shape
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    out = output_for(x, out)
    if tokens == 0 or hidden == 0:
        return out
    tiles = tiles or default_tiles(tokens, top_k, num_experts, x.dtype)
    down_tiles = down_tiles or tiles
    if down_tiles.block_m != tiles.block_m:
        raise ValueError(
            f"down_tiles.block_m must equal tiles.block_m ({tiles.block_m}: one grouping), "
            f"got {down_tiles.block_m}"
        )
    refusal = descriptors_refusal(w13, w2, tiles, down_tiles) if descriptors else None
    if refusal:
        raise ValueError(refusal)
    grouping = group_slots(ids, num_experts, tiles.block_m)
    num_blocks = grouping.block_expert.shape[0]
    num_slots = tokens * top_k
    flat_weights = weights.reshape(-1)  # slot s = t * k + j, as the flattened ids
    inter = torch.empty(num_blocks * tiles.block_m, inter_size, dtype=x.dtype, device=x.device)
    per_slot = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: unused by 16-bit dots
    w13_arg, w2_arg, inter_arg = w13, w2, inter
    if descriptors:
        w13_arg = TensorDescriptor.from_tensor(_rows(w13), [tiles.block_n, tiles.block_k])
        w2_arg = TensorDescriptor.from_tensor(_rows(w2), [down_tiles.block_n, down_tiles.block_k])
        inter_arg = TensorDescriptor.from_tensor(inter, [down_tiles.block_m, down_tiles.block_k])
    _gate_up_kernel[(num_blocks * triton.cdiv(inter_size, tiles.block_n),)](
        x,
        w13_arg,
        inter,
        grouping.sorted_slots,
        grouping.block_expert,
        num_slots,
        top_k,
        hidden,
        inter_size,
        num_experts,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        **_launch(tiles, precision, descriptors),
    )
    _down_kernel[(num_blocks * triton.cdiv(hidden, down_tiles.block_n),)](
        inter_arg,
        w2_arg,
        flat_weights,
        per_slot,
        grouping.sorted_slots,
        grouping.block_expert,
        num_slots,
        hidden,
        inter_size,
        num_experts,
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        **_launch(down_tiles, precision, descriptors),
    )
    _combine_kernel[(tokens, triton.cdiv(hidden, _BLOCK_H))](
        per_slot, out, top_k, hidden, out.stride(0), BLOCK_H=_BLOCK_H, num_warps=_COMBINE_WARPS
    )
    return out
