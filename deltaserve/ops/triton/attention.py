"""Triton kernels for Qwen3.5 gated full attention (the torch reference is deltaserve/ops/attention.py).

`qk_norm_rope_write_kv`: one kernel for zero-centred RMSNorm of q and k per head, partial NeoX RoPE,
the paged K/V write, and the normed+rotated q. Grid (tokens, q heads + kv heads); one head row per
program. Rounding follows the reference composition step by step: the norm is computed in fp32 and
rounded once; cos/sin are computed in fp32 and rounded to the activation dtype; rot*cos and
rotated_half*sin are each rounded, then their sum (what torch does for `a * c + b * s` in bf16).

`paged_attention`: causal GQA attention of a flattened varlen batch (decode rows first, then prefill
chunks) over the paged KV cache, in one launch of `_paged_attention_kernel` whose program range is cut
in two (axis 1 is the kv head in both), or, for steps of at most DECODE_APART_MAX_TOKENS tokens, in two
launches of it (the decode programs on the decode tiles, then the prefill programs):
  * decode programs, pid < num_decodes * splits: (row, split). All `group` query heads of a kv head
    are packed into the rows of one tile (padded to 16 for tl.dot), so each KV page is read once per
    kv head. A row's context is cut into `splits` contiguous ranges (flash-decoding); with splits > 1
    each program writes a normalised partial output and its log2-sum-exp, and `_merge_splits_kernel`
    combines them. The grid depends only on shapes and `splits`, which depends only on shapes
    (rows, kv heads, block-table width) and the SM count: the decode path is CUDA-graph capturable.
  * prefill programs: query tiles of prefill_m rows = block_q = (prefill_m // group) tokens x group
    heads of one sequence (rows tok * group + h; K/V blocks are shared by the whole group). Sequence i owns tiles [start(i), start(i+1)) with
    start(i) = (query_start_loc[i] - query_start_loc[num_decodes]) // block_q + (i - num_decodes),
    which over-covers each sequence by at most one tile; a program finds its sequence by binary search
    over query_start_loc, so no host-built tile map is needed (the vLLM unified-attention scheme).
    KV blocks below the tile's first query position run without masks; the rest run causally masked.
    Programs take the tiles in reverse order (the last prefill program the first tile).
  * a prefill graph's batch counts its leading decode rows on the device (DEVICE_COUNT): the grid has
    decode programs for every row that could be one, those past the count return at once, and the
    prefill programs read the count as their first sequence; prefill tiles are counted for the graph's
    chunk rows only (ForwardBatch.graph_chunks), not for its empty padding sequences.
Kernel variants are selected by constexpr flags (has decode rows / has prefill rows / split), so a
pure-decode batch compiles no prefill code (lower register use, higher occupancy). Per-step integers
are never specialised on (`do_not_specialize`): a new batch size never triggers a JIT compile.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltaserve.ops.batch import ForwardBatch
from deltaserve.ops.triton.activation import mul_f32, round_to
from deltaserve.ops.triton.device_info import sm_count, smem_per_block
from deltaserve.ops.triton.pdl import gdc_enter, launch_options


class _Tiles(NamedTuple):
    """Fixed launch parameters of `_paged_attention_kernel` (no autotuning: nothing compiles or benchmarks
    while serving). Chosen from sm_90 compiles: no register spills and shared memory within 227 KiB."""

    decode_n: int  # keys per decode block; the decode tile has 16 rows (smallest tl.dot M, any group)
    prefill_m: int  # query rows (tokens x group heads) per prefill tile
    prefill_n: int  # keys per prefill block
    num_warps: int
    num_stages: int


# 16-bit activations. Pure decode is memory-bound: 4 warps (168 registers: three CTAs per SM), and 5
# stages, which with the block-table indirection double-buffer the 2 x 32 x 256 K/V tiles (75 KiB).
# With prefill rows: 128-row tiles (K/V reuse: 128 flops per byte of K/V, which keeps wgmma fed from L2)
# x 64 keys, 8 warps, 2 stages: 192 KiB at head dim 256. Timed on an H200 against ten other shapes
# (`python3 -m deltaserve.bench.attention_kernel`): 1.52x the 32-key blocks on an 8192-token chunk,
# 1.53x on 2048 tokens after 6144, 1.16x on a saturated unified step. A GPU with less shared memory
# per block (sm_80: 163 KiB) gets the 32-key blocks (128 KiB).
_TILES_16BIT_DECODE = _Tiles(decode_n=32, prefill_m=128, prefill_n=32, num_warps=4, num_stages=5)
_TILES_16BIT_MIXED = _Tiles(decode_n=32, prefill_m=128, prefill_n=64, num_warps=8, num_stages=2)
_TILES_16BIT_MIXED_SMALL_SMEM = _Tiles(decode_n=32, prefill_m=128, prefill_n=32, num_warps=8, num_stages=2)
# fp32 (tests; IEEE dots are FMA loops): smaller tiles so that shared memory fits.
_TILES_FP32 = _Tiles(decode_n=32, prefill_m=32, prefill_n=32, num_warps=8, num_stages=2)
# A launch of decode rows beside prefill rows shares the prefill tile's warps, stages and shared memory,
# which leave room for one program per SM: the decode rows, bound by KV bandwidth, then read it at a
# fraction of its rate. Up to DECODE_APART_MAX_TOKENS tokens they are launched apart, on the decode
# tiles, before the prefill programs. Past it the prefill tiles keep every SM busy long enough that the
# decode programs run inside their time. Timed on an H200 (bench.attention_kernel, CUDA graphs, 4B/9B
# attention): 226 decode rows + 2 x 911 prefill tokens 516 -> 349 us, 56 + 2 x 996 207 -> 187 us;
# 64 + 8,128 1,822 -> 1,878 us apart (so kept whole); same bits. Saturated 9B over HTTP: 31.7k -> 32.1k
# total tok/s. DELTASERVE_ATTENTION_DECODE_APART=0 keeps every launch whole.
DECODE_APART_MAX_TOKENS = 4096 if os.environ.get("DELTASERVE_ATTENTION_DECODE_APART", "1") != "0" else 0


def prefill_smem_bytes(tiles: _Tiles, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of a prefill tile: the query tile, and K and V blocks for each pipeline stage."""
    return (tiles.prefill_m + 2 * tiles.num_stages * tiles.prefill_n) * head_dim * itemsize


def mixed_tiles(head_dim: int, smem_per_block: int | None) -> _Tiles:
    """The 16-bit tiles of a launch with prefill rows: the larger K/V blocks where they fit the device's
    opt-in shared memory per block (None: no limit, as under the interpreter)."""
    tiles = _TILES_16BIT_MIXED
    if smem_per_block is not None and prefill_smem_bytes(tiles, head_dim) > smem_per_block:
        return _TILES_16BIT_MIXED_SMALL_SMEM
    return tiles


# Split-K for decode: aim for about two programs per SM, never a split shorter than MIN_SPLIT_TOKENS
# of the block-table capacity, never more than MAX_SPLITS (also the merge kernel's lse tile width).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634
# Triton's CPU interpreter (3.6) multiplies bf16 tiles as their raw uint16 bits; there, dots take fp32
# copies of the (already rounded) operands, which is what a bf16 MMA with fp32 accumulation computes.
# Read when the kernels are decorated, as @triton.jit reads TRITON_INTERPRET.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
if not _INTERPRETED:
    from triton.language.extra import libdevice  # the interpreter has no libdevice


def decode_num_splits(num_decodes: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per decode row: a function of shapes and the device only (graph-capture safe)."""
    if num_decodes == 0:
        return 1
    programs = num_decodes * num_kv_heads
    wanted = -(-2 * sm_count(device) // programs)
    by_length = max(1, max_context // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, MAX_SPLITS))


# ----------------------------------------------------------------------------------------------------
# Fused q/k RMSNorm + partial RoPE + paged K/V write
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _cos_sin(x):
    """Accurate fp32 cos/sin (libdevice, with full range reduction, as torch computes them): positions go
    up to 262k, where the hardware approximations lose several bits."""
    if _INTERPRETED:
        return tl.cos(x), tl.sin(x)
    return libdevice.cos(x), libdevice.sin(x)


@triton.jit
def _norm_rope_row(src_ptr, w_ptr, cos, sin, eps, offs, partner, sign, is_rot, HEAD_DIM: tl.constexpr):
    """One head row: zero-centred RMSNorm (fp32, rounded once), then RoPE with per-product rounding."""
    x = tl.load(src_ptr + offs).to(tl.float32)
    x_p = tl.load(src_ptr + partner).to(tl.float32)
    w = tl.load(w_ptr + offs).to(tl.float32)
    w_p = tl.load(w_ptr + partner).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    dtype = src_ptr.dtype.element_ty
    y = round_to(x * rstd * (1.0 + w), dtype).to(tl.float32)
    y_p = round_to(x_p * rstd * (1.0 + w_p), dtype).to(tl.float32)
    # Each product rounded on its own (mul_f32), as torch's rotation rounds it: with a plain multiply the
    # compiler contracts one product and the add into an fma.rn.bf16 and skips that product's rounding.
    y_cos = round_to(mul_f32(y, cos), dtype).to(tl.float32)
    partner_sin = round_to(mul_f32(sign * y_p, sin), dtype).to(tl.float32)
    rot = y_cos + partner_sin
    return round_to(tl.where(is_rot, rot, y), dtype)


@triton.jit(do_not_specialize=["eps"])
def _qk_norm_rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    q_w_ptr,
    k_w_ptr,
    pos_ptr,
    inv_freq_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    first_head = tl.program_id(1) * HEADS_PER_PROGRAM
    half: tl.constexpr = ROTARY_DIM // 2
    offs = tl.arange(0, HEAD_DIM)
    is_rot = offs < ROTARY_DIM
    # rotate_half pairs dim i with i + half (i < half) and negates the upper half's partner.
    partner = tl.where(offs < half, offs + half, tl.where(is_rot, offs - half, offs))
    sign = tl.where(offs < half, -1.0, 1.0)
    freq_idx = tl.where(is_rot, offs % half, 0)
    freqs = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + freq_idx)
    dtype = q_ptr.dtype.element_ty
    # The token's cos/sin (accurate libdevice calls) serve every head this program takes.
    cos, sin = _cos_sin(freqs)
    cos = round_to(cos, dtype).to(tl.float32)
    sin = round_to(sin, dtype).to(tl.float32)
    for h in range(first_head, tl.minimum(first_head + HEADS_PER_PROGRAM, NUM_HEADS + NUM_KV_HEADS)):
        if h < NUM_HEADS:
            src = q_ptr + t * stride_qt + h * stride_qh
            y = _norm_rope_row(src, q_w_ptr, cos, sin, eps, offs, partner, sign, is_rot, HEAD_DIM)
            tl.store(q_out_ptr + t * stride_ot + h * stride_oh + offs, y)
        else:
            kvh = h - NUM_HEADS
            slot = tl.load(slot_ptr + t)
            # A negative slot (vLLM's padding convention) writes nothing.
            if slot >= 0:
                page = slot // PAGE_SIZE
                off = slot % PAGE_SIZE
                src = k_ptr + t * stride_kt + kvh * stride_kh
                y = _norm_rope_row(src, k_w_ptr, cos, sin, eps, offs, partner, sign, is_rot, HEAD_DIM)
                k_dst = k_cache_ptr + page * stride_kcp + off * stride_kcs + kvh * stride_kch
                tl.store(k_dst + offs, y.to(k_cache_ptr.dtype.element_ty))
                v = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + offs)
                v_dst = v_cache_ptr + page * stride_vcp + off * stride_vcs + kvh * stride_vch
                tl.store(v_dst + offs, v.to(v_cache_ptr.dtype.element_ty))


# From this many tokens one program takes all of a token's heads: its cos/sin are computed once instead
# of once per head (at 8192 tokens the per-head grid took ~200 us per layer, ~0.9 TB/s, recomputing
# libdevice's cos/sin for each of 20 heads x 256 dims). Below it, one program per (token, head) keeps a
# decode step's few rows spread over the SMs. The same bits either way.
QK_NORM_TOKENS_PER_TOKEN_GRID = 1024


def qk_norm_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] (views of the fused qkv output are fine:
    only the last dim must be contiguous). Normalises q and k per head (zero-centred RMSNorm), rotates
    the first 2 * len(inv_freq) dims (NeoX), writes K and V at `slot_mapping` into the paged caches and
    returns the normed+rotated q ([T, heads, head_dim] in q's dtype; written into `out` when given).
    A negative slot writes nothing (vLLM's padding convention; the reference has no such slots).

    Equals rms_norm -> apply_rotary(rotary_cos_sin(positions, inv_freq, q.dtype)) -> write_kv."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = 2 * inv_freq.numel()
    page_size = k_cache.shape[1]
    _check(
        k.shape == v.shape == (tokens, num_kv_heads, head_dim),
        f"k/v of shape {tuple(k.shape)}/{tuple(v.shape)}, expected ({tokens}, kv_heads, {head_dim})",
    )
    _check(k.dtype == v.dtype == q.dtype, f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} differ")
    _check(q_norm_w.dtype == k_norm_w.dtype, "q_norm and k_norm weights must share a dtype")
    _check(q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "q/k/v need a contiguous last dim")
    _check(_is_pow2(head_dim), f"head_dim {head_dim} must be a power of two")
    _check(rotary_dim <= head_dim and rotary_dim % 2 == 0, f"rotary_dim {rotary_dim} > head_dim {head_dim}")
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    q_out = _output(out, q)
    if tokens == 0:
        return q_out
    total_heads = num_heads + num_kv_heads
    heads_per_program = total_heads if tokens >= QK_NORM_TOKENS_PER_TOKEN_GRID else 1
    _qk_norm_rope_write_kv_kernel[(tokens, triton.cdiv(total_heads, heads_per_program))](
        q,
        k,
        v,
        q_out,
        q_norm_w,
        k_norm_w,
        positions,
        inv_freq,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        PAGE_SIZE=page_size,
        HEADS_PER_PROGRAM=heads_per_program,
        num_warps=2,
        **launch_options(q.device),
    )
    return q_out


# ----------------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    if _INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    start,
    kv_hi,
    q_pos,
    bt_row_ptr,
    k_head_ptr,
    v_head_ptr,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with keys [start, start + BLOCK_N). Unmasked blocks
    must lie entirely below kv_hi and below every row's query position."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_n < kv_hi
    if MASKED:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    k_ptrs = k_head_ptr + (page * stride_kp + in_page * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = v_head_ptr + (page * stride_vp + in_page * stride_vs)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
    if MASKED:
        keep = in_range[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
    # m_i starts finite (-1e30), so a row whose keys are all masked keeps alpha = 1 and p = 0.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_range(
    q,
    q_pos,
    kv_lo,
    full_hi,
    kv_hi,
    bt_row_ptr,
    k_head_ptr,
    v_head_ptr,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    qk_scale,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attention of q's rows over keys [kv_lo, kv_hi): blocks below full_hi (a multiple of BLOCK_N
    above kv_lo, at most every row's first visible-to-all bound) unmasked, the rest masked causally.
    Returns the unnormalised accumulator, the running max (log2 domain) and the softmax denominator."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(kv_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, start, kv_hi, q_pos, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    for start in range(full_hi, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, start, kv_hi, q_pos, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _decode_program(
    pid,
    kvh,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_splits,
    num_heads,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One decode row (one token, all `group` heads of kv head kvh) over one split of its context."""
    row = pid // num_splits
    split = pid % num_splits
    token = tl.load(qsl_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row)
    # Splits are whole BLOCK_N blocks; trailing splits of a short row are empty (kv_lo >= kv_hi).
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, seq_len)
    full_hi = tl.maximum(kv_lo + (kv_hi - kv_lo) // BLOCK_N * BLOCK_N, kv_lo)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < GROUP
    heads = kvh * GROUP + offs_m
    q_ptrs = q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    q_pos = tl.full([BLOCK_M], 0, tl.int32) + (seq_len - 1)
    acc, m_i, l_i = _attend_range(
        q, q_pos, kv_lo, full_hi, kv_hi,
        bt_ptr + row.to(tl.int64) * stride_bt,
        k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_vh,
        stride_kp, stride_ks, stride_vp, stride_vs, qk_scale,
        BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if SPLIT:
        # Partials: [rows, heads, splits, head_dim] outputs and [rows, heads, splits] log2-sum-exp.
        part = (row.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
    else:
        o_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _prefill_program(
    tile,
    kvh,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    first_seq,
    num_seqs,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One query tile of a prefill chunk: BLOCK_Q tokens x GROUP heads packed as rows tok * GROUP + h."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    base = tl.load(qsl_ptr + first_seq)
    # Binary search: the last sequence i in [first_seq, num_seqs) with tile_start(i) <= tile.
    lo = first_seq
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = (tl.load(qsl_ptr + mid) - base) // BLOCK_Q + (mid - first_seq)
        if mid_start <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_tok0 = (tile - ((q_start - base) // BLOCK_Q + (seq - first_seq))) * BLOCK_Q
    if tile_tok0 < q_len:
        context = seq_len - q_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        tok = tile_tok0 + offs_m // GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        heads = kvh * GROUP + offs_m % GROUP
        token = (q_start + tok).to(tl.int64)
        q_ptrs = q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        q_pos = context + tok
        # Keys below the tile's first query position are visible to every row: no mask needed there.
        first_pos = context + tile_tok0
        kv_hi = context + tl.minimum(tile_tok0 + BLOCK_Q, q_len)
        full_hi = first_pos // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_range(
            q, q_pos, 0, full_hi, kv_hi,
            bt_ptr + seq.to(tl.int64) * stride_bt,
            k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_vh,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale,
            BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_decodes", "num_splits", "num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    count_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_decodes,
    num_splits,
    num_seqs,
    qk_scale,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DECODE_M: tl.constexpr,
    DECODE_N: tl.constexpr,
    PREFILL_M: tl.constexpr,
    PREFILL_N: tl.constexpr,
    HAS_DECODE: tl.constexpr,
    HAS_PREFILL: tl.constexpr,
    SPLIT: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # The first num_decodes * num_splits programs are decode programs. With DEVICE_COUNT (a prefill
    # graph's batch) num_decodes is room for decode rows and count_ptr holds how many lead the batch:
    # the decode programs past them do nothing, and the prefill programs start at that sequence.
    # A launch of prefill programs only (the decode rows launched on their own) has none before them.
    if HAS_DECODE:
        decode_programs = num_decodes * num_splits
    else:
        decode_programs = 0
    if DEVICE_COUNT:
        live_decodes = tl.load(count_ptr)
    else:
        live_decodes = num_decodes
    # Nested ifs on purpose: the outer constexpr test removes the branch at compile time; `and` with a
    # runtime operand would keep it as (dead) runtime code.
    if HAS_DECODE:  # noqa: SIM102
        if pid < live_decodes * num_splits:
            _decode_program(
                pid, kvh, q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                qsl_ptr, seq_lens_ptr, bt_ptr, stride_qt, stride_qh, stride_kp, stride_ks, stride_kh,
                stride_vp, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt, num_splits, NUM_HEADS,
                qk_scale, GROUP, HEAD_DIM, PAGE_SIZE, DECODE_M, DECODE_N, SPLIT, DOT_PRECISION,
            )  # fmt: skip
    if HAS_PREFILL:  # noqa: SIM102
        if pid >= decode_programs:
            # Prefill tiles in reverse: a sequence's last tiles (the most keys) start first, so the last
            # wave holds the shortest tiles instead of the longest (-10% at one 8,192-token prompt).
            _prefill_program(
                tl.num_programs(0) - 1 - pid, kvh, q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                qsl_ptr, seq_lens_ptr, bt_ptr, stride_qt, stride_qh, stride_kp, stride_ks, stride_kh,
                stride_vp, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt, live_decodes, num_seqs,
                qk_scale, GROUP, HEAD_DIM, PAGE_SIZE, PREFILL_M, PREFILL_N, DOT_PRECISION,
            )  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    count_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """out[row, head] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M); empty splits have lse = -inf.
    With DEVICE_COUNT only the rows below the count at count_ptr (the others were not decoded)."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    if DEVICE_COUNT:
        live_rows = tl.load(count_ptr).to(tl.int64)
    else:
        live_rows = tl.num_programs(0).to(tl.int64)
    if row < live_rows:
        head = tl.program_id(1)
        part = (row * NUM_HEADS + head) * num_splits
        offs_s = tl.arange(0, MAX_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        lse = tl.load(part_lse_ptr + part + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # a row without keys yields zeros, not NaN
        denom = tl.sum(tl.exp2(lse - m), 0)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s in range(0, num_splits):
            w = tl.exp2(tl.load(part_lse_ptr + part + s) - m)
            acc += w * tl.load(part_out_ptr + (part + s) * HEAD_DIM + offs_d)
        o = acc / tl.where(denom > 0.0, denom, 1.0)
        token = tl.load(qsl_ptr + row).to(tl.int64)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    seqs: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim] for the batch's new tokens, whose K/V are already written. Returns
    [T, heads, head_dim] in q's dtype (written into `out` when given); softmax in fp32. Same
    semantics as the torch reference. With `seqs` (an eager batch, at least its decode rows) only the
    first `seqs` sequences are attended: the rows of the others are left as they are in `out`.

    Reads no host data but `batch.num_decodes`, shapes (and with `seqs` the host query lengths), and
    never syncs: CUDA-graph capturable.
    `num_splits` overrides the decode split count, which otherwise follows from the decode rows, kv
    heads, the block table's capacity (block_tables.shape[1] * page_size, the fixed max-context bound)
    and the SM count.

    A prefill graph's batch (`batch.graph_decodes`: every row a varlen sequence, the count of leading
    decode rows on the device) gets decode programs for as many rows as it has sequences or tokens,
    the fewer; those past the count do nothing, and every sequence after them is a prefill row. So its
    decode rows are attended as an eager step's are (split, 16-row tiles), not as one-token prefill
    tiles."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    _check_attention_inputs(q, k_cache, v_cache, batch)
    num_seqs = batch.query_start_loc.shape[0] - 1
    device_count = batch.graph_decodes
    if device_count is not None:
        _check(batch.num_decodes == 0, f"num_decodes {batch.num_decodes} with graph_decodes, expected 0")
        _check(batch.graph_chunks is not None, "graph_decodes without graph_chunks")
        _check(seqs is None, "seqs with a graph's batch (its host lists are the capture's)")
        num_decodes = min(num_seqs, tokens)  # room; the live count is read on the device
        num_prefills = min(num_seqs, batch.graph_chunks)  # those after them are empty padding
    else:
        num_decodes = batch.num_decodes
        if seqs is not None:
            _check(num_decodes <= seqs <= num_seqs, f"seqs {seqs} outside [{num_decodes}, {num_seqs}]")
            num_seqs, tokens = seqs, sum(batch.query_lens_host[:seqs])
        num_prefills = num_seqs - num_decodes
    out = _output(out, q)
    if tokens == 0:
        return out
    if num_splits is None:
        max_context = batch.block_tables.shape[1] * k_cache.shape[1]
        num_splits = decode_num_splits(num_decodes, num_kv_heads, max_context, q.device)
    _check(1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} outside [1, {MAX_SPLITS}]")
    split = num_decodes > 0 and num_splits > 1
    num_splits = num_splits if split else 1
    if split:
        part_out = q.new_empty((num_decodes, num_heads, num_splits, head_dim), dtype=torch.float32)
        part_lse = q.new_empty((num_decodes, num_heads, num_splits), dtype=torch.float32)
    else:
        part_out = part_lse = out  # never touched: SPLIT is off
    if q.dtype == torch.float32:
        decode_tiles = mixed = _TILES_FP32
    else:
        decode_tiles = _TILES_16BIT_DECODE
        mixed = mixed_tiles(head_dim, smem_per_block(q.device))
    # Decode rows hold one token each, so prefill rows hold tokens - num_decodes; each prefill sequence
    # gets at most one tile more than it needs (see the module docstring). With a device count the tiles
    # are counted for none of the rows being decode rows, the most they can need; the empty padding
    # sequences after the chunks would start past them and get none.
    apart = num_decodes > 0 and num_prefills > 0 and tokens <= DECODE_APART_MAX_TOKENS
    tiles = decode_tiles if num_prefills == 0 else mixed
    block_q = tiles.prefill_m // group
    prefill_tokens = tokens if device_count is not None else tokens - num_decodes
    prefill_programs = prefill_tokens // block_q + num_prefills if num_prefills > 0 else 0

    def launch(programs: int, program_tiles: _Tiles, has_decode: bool, has_prefill: bool) -> None:
        _paged_attention_kernel[(programs, num_kv_heads)](
            q,
            k_cache,
            v_cache,
            out,
            part_out,
            part_lse,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            batch.query_start_loc if device_count is None else device_count,  # read only with DEVICE_COUNT
            q.stride(0),
            q.stride(1),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            out.stride(0),
            out.stride(1),
            batch.block_tables.stride(0),
            num_decodes,
            num_splits,
            num_seqs,
            scale * _LOG2E,
            NUM_HEADS=num_heads,
            GROUP=group,
            HEAD_DIM=head_dim,
            PAGE_SIZE=k_cache.shape[1],
            DECODE_M=16,
            DECODE_N=program_tiles.decode_n,
            PREFILL_M=program_tiles.prefill_m,
            PREFILL_N=program_tiles.prefill_n,
            HAS_DECODE=has_decode,
            HAS_PREFILL=has_prefill,
            SPLIT=split,
            DEVICE_COUNT=device_count is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=program_tiles.num_warps,
            num_stages=program_tiles.num_stages,
            **launch_options(q.device),
        )

    if apart:
        launch(num_decodes * num_splits, decode_tiles, has_decode=True, has_prefill=False)
        launch(prefill_programs, tiles, has_decode=False, has_prefill=True)
    else:
        launch(num_decodes * num_splits + prefill_programs, tiles, num_decodes > 0, num_prefills > 0)
    if split:
        _merge_splits_kernel[(num_decodes, num_heads)](
            out,
            part_out,
            part_lse,
            batch.query_start_loc,
            batch.query_start_loc if device_count is None else device_count,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            MAX_SPLITS=MAX_SPLITS,
            DEVICE_COUNT=device_count is not None,
            num_warps=2,
            **launch_options(q.device),
        )
    return out


def _check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    _check(q.stride(-1) == 1, "q needs a contiguous last dim")
    _check(
        k_cache.dtype == v_cache.dtype == q.dtype,
        f"q/k_cache/v_cache dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype} differ",
    )
    _check(
        num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} kv heads"
    )
    _check(num_heads // num_kv_heads <= 16, f"GQA group {num_heads // num_kv_heads} > 16 is not supported")
    _check(_is_pow2(head_dim) and head_dim >= 16, f"head_dim {head_dim} must be a power of two >= 16")
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    _check(batch.block_tables.stride(1) == 1, "block_tables needs a contiguous last dim")


def _output(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _check(
        out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1,
        f"out of shape {tuple(out.shape)} and dtype {out.dtype}, expected {tuple(q.shape)} {q.dtype} "
        "with a contiguous last dim",
    )
    return out


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    _check(
        k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    )
    _check(
        k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim),
        f"KV cache of shape {tuple(k_cache.shape)}, expected (pages, page_size, {num_kv_heads}, {head_dim})",
    )
    _check(_is_pow2(k_cache.shape[1]), f"page_size {k_cache.shape[1]} must be a power of two")
    _check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV caches need a contiguous last dim")
