"""Weight-streaming linears for decode: y = x @ W^T with x [M, K] and W [N, K] row-major, M <= 16.

The GEMV takes up to GEMV_MAX_ROWS rows (batch-1 decode; a speculative verify row of up to 4 tokens)
and streams the weight once for all of them; the skinny GEMM takes 2..16 rows and reads the weight
once for all rows on the tensor cores. ops.linear routes one row to the GEMV and, by default, nothing
else here (DELTASERVE_GEMV_ROWS and DELTASERVE_SKINNY_GEMM switch the others on; ops/settings.py).

The GEMV also takes a SwiGLU MLP's [gate | up] row in place of x (gemv_swiglu): each program computes
silu(gate) * up for its K block as the weight streams by, rounded as the silu_and_mul kernel rounds it,
so the down projection at batch-1 decode needs no activation kernel and gets the same bits.

GEMV:

At one row a linear layer is a pure stream of its weight; cuBLAS's M = 1 kernels reach 2.0-3.7 TB/s
on an H200 at the Qwen3.5-4B shapes (worst on the N = 2560 projections), this kernel 2.8-3.9 TB/s
(measured inside CUDA graphs, weights cycling through more than the L2). Each program owns BLOCK_N
output rows and streams them over K with an elementwise fp32 accumulator [BLOCK_N, BLOCK_K], reduced
once at the end, so the inner loop is loads and FMAs only.

Numerics: products and sums in fp32, rounded once to the output dtype; the summation order differs
from cuBLAS's (as cuBLAS's differs between its own kernels), so results agree to fp32 rounding before
the final cast. The block shape is autotuned per (N, K, rows) on the GPU; the first call at a new shape
tunes (engine warm-up makes those calls before serving, and before CUDA-graph capture).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.ops.settings import parse_switch
from deltaserve.ops.triton.activation import _INTERPRETER, round_to, sigmoid_f32, silu_f32
from deltaserve.ops.triton.conv1d import conv_silu
from deltaserve.ops.triton.pdl import gdc_enter, launch_options
from deltaserve.ops.triton.prefetch import issue_share, prefetch_bytes

# (BLOCK_N, BLOCK_K, warps): the winners of a sweep over 4..32 x 256..1024 x 4..8 at the 4B shapes
# (few rows per program for the narrow N = 2560 projections, wider for N >= 10k).
_CONFIGS = [(4, 1024, 8), (4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8)]
_INTERPRETER_BLOCKS = (8, 64)
GATED_NORM_MAX_HEAD_DIM = min(k for _, k, _ in _CONFIGS)  # every tuned K block holds whole heads


GEMV_MAX_ROWS = 4  # rows streamed together (a K = 3 verify row has 4 tokens)


# Each GEMV program loads its first K block of the weight before the PDL wait (see _gemv_kernel), so the
# first wave's weight stream starts under the short kernels before the GEMV. The same bits either way.
# On by default: on an H100 at the 4B shape, c1 over HTTP, TPOT 3.47 ms against 3.51 (two runs against
# three; docs/benchmarks/2026-12-06-h100-gemv-preload.md). DELTASERVE_GEMV_PRELOAD=0 turns it off.
PRELOAD = parse_switch("DELTASERVE_GEMV_PRELOAD", os.environ.get("DELTASERVE_GEMV_PRELOAD", "1"))


@dataclass(frozen=True, slots=True)
class DecodeConv:
    """A Gated DeltaNet layer's causal conv for its in_proj GEMV to apply at decode rows (one token each,
    context > 0): weight [C, KW] (C conv channels, in_proj's first outputs), state [slots, C, KW - 1]
    (shifted in place at each row's slot), slots [M] (the rows' state slots, integers)."""

    weight: torch.Tensor
    state: torch.Tensor
    slots: torch.Tensor

    def problem(self, rows: int, outputs: int) -> str | None:
        """Why the GEMV cannot apply this conv to `rows` rows of `outputs` outputs, or None."""
        channels, taps = self.weight.shape
        if channels > outputs or taps < 2 or self.state.shape[1:] != (channels, taps - 1):
            return (
                f"the conv needs weight (C <= {outputs}, KW >= 2) and state (slots, C, KW - 1), got "
                f"{tuple(self.weight.shape)} and {tuple(self.state.shape)}"
            )
        if self.slots.shape != (rows,) or self.slots.dtype.is_floating_point:
            return f"the conv needs {rows} integer slots, got {tuple(self.slots.shape)} {self.slots.dtype}"
        return None


@dataclass(frozen=True, slots=True)
class NextWeight:
    """The projection a GEMV's step streams next: up to `max_bytes` of its start are prefetched into L2
    as the GEMV's programs end."""

    weight: torch.Tensor
    max_bytes: int


# What the GEMV reads as x (its MODE): a plain row, a SwiGLU MLP's [gate | up] row, an attention output
# row with its per-head sigmoid gate (Qwen3.5's gated attention: o_proj(attn * sigmoid(gate))), a
# Gated DeltaNet output row with its per-head gated RMSNorm (out_proj(norm(o) * w * silu(z))), or a hidden
# row under the zero-centred RMSNorm of a layer's input (RMS_NORM; ADD_RMS_NORM adds the residual first
# and writes the sum, the next residual).
PLAIN, SWIGLU, SIGMOID_GATE, GATED_NORM, RMS_NORM, ADD_RMS_NORM = 0, 1, 2, 3, 4, 5
RMS_NORM_MAX_K = 8192  # a program holds the whole row in registers for its sum of squares


@triton.jit
def _load_x(
    x_row_ptr,
    g_row_ptr,
    nw_ptr,
    eps,
    rstd,
    cols,
    col_ok,
    K,
    stride_gh,
    MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x[cols] in fp32, rounded as the unfused ops round it. The gate of column c (SIGMOID_GATE's, or
    GATED_NORM's z) is at g_row_ptr + (c // HEAD_DIM) * stride_gh + c % HEAD_DIM.
    SWIGLU: the row holds gate | up (2K wide); x = silu(gate) * up as the silu_and_mul kernel rounds it
    (the same bits). SIGMOID_GATE: x = row * sigmoid(gate), the sigmoid rounded to the dtype, then the
    product, as torch rounds them (the same bits). GATED_NORM: per head (HEAD_DIM columns, whole heads
    in a block), RMSNorm of the row times the norm weight nw, times silu(z), rounded at the steps where
    the gated_rms_norm kernel rounds; its sum of squares may add in another order (the last fp32 bit of
    the variance). RMS_NORM / ADD_RMS_NORM: s = the row (plus the residual row at g_row_ptr, rounded: the
    new residual), s * rstd * (1 + nw) rounded once, as the rms_norm kernel computes it (rstd from
    _row_rstd)."""
    if MODE == 4 or MODE == 5:
        s = tl.load(x_row_ptr + cols, mask=col_ok, other=0.0)
        if MODE == 5:
            r = tl.load(g_row_ptr + cols, mask=col_ok, other=0.0)
            s = round_to(s.to(tl.float32) + r.to(tl.float32), s.dtype)
        w = 1.0 + tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        return round_to(s.to(tl.float32) * rstd * w, s.dtype).to(tl.float32)
    elif MODE == 1:
        gate = tl.load(x_row_ptr + cols, mask=col_ok, other=0.0)
        up = tl.load(x_row_ptr + K + cols, mask=col_ok, other=0.0)
        act = round_to(silu_f32(gate.to(tl.float32)), gate.dtype)
        return round_to(act.to(tl.float32) * up.to(tl.float32), gate.dtype).to(tl.float32)
    elif MODE == 2:
        x = tl.load(x_row_ptr + cols, mask=col_ok, other=0.0)
        gate_at = g_row_ptr + (cols // HEAD_DIM) * stride_gh + cols % HEAD_DIM
        gate = tl.load(gate_at, mask=col_ok, other=0.0)
        sig = round_to(sigmoid_f32(gate.to(tl.float32)), x.dtype)
        return round_to(x.to(tl.float32) * sig.to(tl.float32), x.dtype).to(tl.float32)
    elif MODE == 3:
        x_raw = tl.load(x_row_ptr + cols, mask=col_ok, other=0.0)
        x = tl.reshape(x_raw.to(tl.float32), (BLOCK_K // HEAD_DIM, HEAD_DIM))
        var = tl.div_rn(tl.sum(x * x, axis=1), HEAD_DIM * 1.0)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        normed = tl.reshape(round_to(x * rstd[:, None], x_raw.dtype), (BLOCK_K,))
        nw = tl.load(nw_ptr + cols % HEAD_DIM).to(tl.float32)
        y = round_to(normed.to(tl.float32) * nw, x_raw.dtype)
        z = tl.load(g_row_ptr + (cols // HEAD_DIM) * stride_gh + cols % HEAD_DIM, mask=col_ok, other=0.0)
        return round_to(y.to(tl.float32) * silu_f32(z.to(tl.float32)), x_raw.dtype).to(tl.float32)
    else:
        return tl.load(x_row_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _store_row(out_row_ptr, acc, rows, row_ok):
    tl.store(out_row_ptr + rows, round_to(tl.sum(acc, axis=1), out_row_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _row_rstd(x_row_ptr, g_row_ptr, res_out_row_ptr, eps, K, MODE: tl.constexpr, K_POW2: tl.constexpr):
    """1 / sqrt(mean(s^2) + eps) of the whole row s (RMS_NORM: the row; ADD_RMS_NORM: the row plus the
    residual row, rounded, which program 0 stores at res_out_row_ptr), as the rms_norm kernel computes
    it; the sum of squares may add in another order (the last fp32 bit of the variance)."""
    kk = tl.arange(0, K_POW2)
    ok = kk < K
    s = tl.load(x_row_ptr + kk, mask=ok, other=0.0)
    if MODE == 5:
        r = tl.load(g_row_ptr + kk, mask=ok, other=0.0)
        s = round_to(s.to(tl.float32) + r.to(tl.float32), s.dtype)
        if tl.program_id(0) == 0:
            tl.store(res_out_row_ptr + kk, s, mask=ok)
    s32 = s.to(tl.float32)
    var = tl.div_rn(tl.sum(s32 * s32), K * 1.0)
    return tl.div_rn(1.0, tl.sqrt_rn(var + eps))


@triton.jit
def _store_conv_row(
    out_row_ptr,
    acc,
    rows,
    row_ok,
    conv_channels,
    conv_w_ptr,
    conv_state_row_ptr,
    stride_cw_ch,
    stride_cw_k,
    stride_cs_ch,
    stride_cs_k,
    KW: tl.constexpr,
):
    """A Gated DeltaNet in_proj row at a decode row: outputs below conv_channels (q | k | v) leave as
    silu(conv(.)) over the slot's last KW-1 inputs, whose window shifts to take this one, exactly as the
    conv1d decode kernel computes and updates them (each channel is one program's); the rest (z | b | a)
    as they are. conv_state_row_ptr: the token's slot in the conv state."""
    dtype: tl.constexpr = out_row_ptr.dtype.element_ty
    y = round_to(tl.sum(acc, axis=1), dtype)  # as _store_row stores it: the conv kernel's input
    is_conv = row_ok & (rows < conv_channels)
    state = conv_state_row_ptr + rows.to(tl.int64) * stride_cs_ch
    taps = conv_w_ptr + rows.to(tl.int64) * stride_cw_ch
    conv = tl.zeros(rows.shape, dtype=tl.float32)
    window = ()  # the slot's inputs as stored, oldest first
    for k in tl.static_range(KW - 1):  # oldest first, as the conv kernels sum
        stored = tl.load(state + k * stride_cs_k, mask=is_conv, other=0.0)
        window = window + (stored,)
        old = round_to(stored.to(tl.float32), dtype)
        conv += tl.load(taps + k * stride_cw_k, mask=is_conv, other=0.0).to(tl.float32) * old.to(tl.float32)
    conv += tl.load(taps + (KW - 1) * stride_cw_k, mask=is_conv, other=0.0).to(tl.float32) * y.to(tl.float32)
    # A channel's values may sit in several threads (the reduction's replicas, a store's own layout), so
    # every thread's read of the windows is issued before any thread shifts them.
    tl.debug_barrier()
    for p in tl.static_range(KW - 2):  # the window shifts left
        tl.store(state + p * stride_cs_k, window[p + 1], mask=is_conv)
    newest = round_to(y.to(tl.float32), conv_state_row_ptr.dtype.element_ty)
    tl.store(state + (KW - 2) * stride_cs_k, newest, mask=is_conv)
    tl.store(out_row_ptr + rows, tl.where(is_conv, conv_silu(conv, dtype), y), mask=row_ok)


@triton.jit
def _store_swiglu_row(out_row_ptr, acc_gate, acc_up, rows, row_ok):
    """silu(gate) * up of this program's rows, each half rounded as _store_row stores it and the product
    as the silu_and_mul kernel rounds it: the bits of the GEMV then the activation kernel."""
    dtype: tl.constexpr = out_row_ptr.dtype.element_ty
    gate = round_to(tl.sum(acc_gate, axis=1), dtype)
    up = round_to(tl.sum(acc_up, axis=1), dtype)
    act = round_to(silu_f32(gate.to(tl.float32)), dtype)
    tl.store(out_row_ptr + rows, round_to(act.to(tl.float32) * up.to(tl.float32), dtype), mask=row_ok)


@triton.jit
def _load_xs(
    x_ptr,
    g_ptr,
    nw_ptr,
    eps,
    rstds,
    cols,
    col_ok,
    K,
    stride_xm,
    stride_gm,
    stride_gh,
    ROWS: tl.constexpr,
    MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x_r[cols] in fp32 for each row r (_load_x)."""
    xs = ()
    for r in tl.static_range(ROWS):
        x = _load_x(
            x_ptr + r * stride_xm,
            g_ptr + r * stride_gm,
            nw_ptr,
            eps,
            rstds[r],
            cols,
            col_ok,
            K,
            stride_gh,
            MODE,
            HEAD_DIM,
            BLOCK_K,
        )
        xs = xs + (x,)
    return xs


@triton.jit
def _accumulate(accs, w, xs, ROWS: tl.constexpr):
    """accs[r] + w * xs[r] for each row r: one K block of the GEMV (w in fp32)."""
    summed = ()
    for r in tl.static_range(ROWS):
        summed = summed + (accs[r] + w * xs[r][None, :],)
    return summed


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    g_ptr,
    nw_ptr,
    res_out_ptr,
    conv_w_ptr,
    conv_state_ptr,
    conv_slots_ptr,
    eps,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_gm,
    stride_gh,
    conv_channels,
    stride_cw_ch,
    stride_cw_k,
    stride_cs_slot,
    stride_cs_ch,
    stride_cs_k,
    pf_base,
    pf_bytes,
    ROWS: tl.constexpr,
    MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_POW2: tl.constexpr,
    SWIGLU_OUT: tl.constexpr,
    CONV_KW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    PRELOAD: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # Each weight tile is loaded once for all ROWS rows (1..4), each row with its own accumulator in the
    # same order, so a row's bits depend only on that row and W (and the block shape). SWIGLU_OUT: W is a
    # SwiGLU MLP's [gate; up] (2N rows); a program streams its N-rows of both halves and writes
    # silu(gate) * up, N wide. CONV_KW > 0: W is a Gated DeltaNet in_proj at decode rows, its first
    # conv_channels outputs convolved with the conv state of each row's slot (_store_conv_row).
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    w_up_rows = w_rows + tl.cast(N, tl.int64) * stride_wn  # N may be the constant 1 (Triton specializes it)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    tile_ok = row_ok[:, None] & col_ok[None, :]
    if PRELOAD:
        # The weight is read-only while steps run (no kernel writes it), so the first K block may load
        # before the PDL wait: a program scheduled early streams it under the kernels before this one.
        w_first = tl.load(w_rows + cols[None, :], mask=tile_ok, other=0.0)
        if SWIGLU_OUT:
            w_up_first = tl.load(w_up_rows + cols[None, :], mask=tile_ok, other=0.0)
    gdc_enter(USE_GDC)
    accs = ()
    rstds = ()  # RMS_NORM / ADD_RMS_NORM: each row's, from the whole row before its first block
    for r in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32),)
        if MODE == 4 or MODE == 5:
            rstd = _row_rstd(
                x_ptr + r * stride_xm, g_ptr + r * stride_gm, res_out_ptr + r * K, eps, K, MODE, K_POW2
            )
        else:
            rstd = 0.0
        rstds = rstds + (rstd,)
    accs_up = accs
    if PRELOAD:  # the loop's first block, in the same order: the same bits
        xs = _load_xs(
            x_ptr, g_ptr, nw_ptr, eps, rstds, cols, col_ok, K, stride_xm, stride_gm, stride_gh,
            ROWS, MODE, HEAD_DIM, BLOCK_K,
        )  # fmt: skip
        accs = _accumulate(accs, w_first.to(tl.float32), xs, ROWS)
        if SWIGLU_OUT:
            accs_up = _accumulate(accs_up, w_up_first.to(tl.float32), xs, ROWS)
    for k0 in range(BLOCK_K * PRELOAD, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        tile_ok = row_ok[:, None] & col_ok[None, :]
        w = tl.load(w_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        if SWIGLU_OUT:
            w_up = tl.load(w_up_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        xs = _load_xs(
            x_ptr, g_ptr, nw_ptr, eps, rstds, cols, col_ok, K, stride_xm, stride_gm, stride_gh,
            ROWS, MODE, HEAD_DIM, BLOCK_K,
        )  # fmt: skip
        accs = _accumulate(accs, w, xs, ROWS)
        if SWIGLU_OUT:
            accs_up = _accumulate(accs_up, w_up, xs, ROWS)
    for r in tl.static_range(ROWS):
        if SWIGLU_OUT:
            _store_swiglu_row(out_ptr + r * stride_om, accs[r], accs_up[r], rows, row_ok)
        elif CONV_KW > 0:
            slot = tl.load(conv_slots_ptr + r).to(tl.int64)
            _store_conv_row(
                out_ptr + r * stride_om, accs[r], rows, row_ok, conv_channels, conv_w_ptr,
                conv_state_ptr + slot * stride_cs_slot, stride_cw_ch, stride_cw_k, stride_cs_ch, stride_cs_k,
                CONV_KW,
            )  # fmt: skip
        else:
            _store_row(out_ptr + r * stride_om, accs[r], rows, row_ok)
    if PREFETCH:  # the next projection's first pf_bytes at pf_base, a share per program
        issue_share(pf_base, pf_bytes)


_gemv_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in _CONFIGS],
    key=["N", "K", "ROWS", "MODE", "SWIGLU_OUT", "CONV_KW", "PRELOAD"],
    restore_value=["conv_state_ptr"],  # tuning runs a config more than once: each shifts the conv window
    cache_results=True,  # the winners persist in Triton's cache directory: a restart does not re-tune
)(_gemv_kernel)


# Skinny GEMM: rows padded to one 16-row MMA tile; (BLOCK_N, BLOCK_K, warps, stages).
SKINNY_MAX_ROWS = 16
_SKINNY_CONFIGS = [
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 4, 4),
    (32, 128, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 8, 3),
]
_SKINNY_INTERPRETER_BLOCKS = (16, 32)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # Invariant: a row's result depends only on that row and W (the same tile order for every M), so
    # a token gets the same bits at any row of a 2..16-row batch.
    gdc_enter(USE_GDC)
    rows_m = tl.arange(0, 16)
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rows_m < M
    n_ok = rows_n < N
    x_rows = x_ptr + rows_m[:, None] * stride_xm
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0)
        w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        if _INTERPRETER:  # the interpreter's dot mishandles bf16 operands
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    out = out_ptr + rows_m[:, None] * stride_om + rows_n[None, :]
    tl.store(out, round_to(acc, out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_skinny_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in _SKINNY_CONFIGS
    ],
    key=["N", "K"],  # not M: every row count shares a shape's config (the invariant above)
    cache_results=True,
)(_skinny_kernel)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K] with 1 <= M <= 16 (any row stride, unit column stride); weight: [N, K] with unit column
    stride. Returns [M, N] in x's dtype; products and sums in fp32, rounded once."""
    _check_operands(x, weight, max_rows=SKINNY_MAX_ROWS)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if _INTERPRETER:
        block_n, block_k = _SKINNY_INTERPRETER_BLOCKS
        _skinny_kernel[(triton.cdiv(n, block_n),)](
            x,
            weight,
            out,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            **launch_options(x.device),
        )
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _skinny_tuned[grid](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), **launch_options(x.device)
        )
    return out


def _check_operands(x: torch.Tensor, weight: torch.Tensor, *, max_rows: int) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_rows:
        what = "one row: x of shape (1, K)" if max_rows == 1 else f"1..{max_rows} rows: x of shape (M, K)"
        raise ValueError(f"takes {what}, got {tuple(x.shape)}")
    k = weight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight's K is {k}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x dtype {x.dtype} differs from the weight dtype {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("needs a unit column stride in x and the weight")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    prefetch: NextWeight | None = None,
    conv: DecodeConv | None = None,
) -> torch.Tensor:
    """x: [M, K] with 1 <= M <= GEMV_MAX_ROWS (any row stride, unit column stride); weight: [N, K] with
    unit column stride (row slices of a larger matrix are fine). Returns [M, N] in x's dtype, written
    into `out` when given (contiguous). The weight is streamed once for all M rows. `prefetch` (every
    GEMV takes it): the next projection's weight, whose first bytes the programs prefetch into L2 as they
    end (ops/triton/prefetch.py; a Hopper GPU only). `conv`: a Gated DeltaNet
    in_proj at decode rows, its first conv channels convolved as they are written (DecodeConv)."""
    _check_operands(x, weight, max_rows=GEMV_MAX_ROWS)
    _check_conv(conv, x.shape[0], weight.shape[0])
    return _launch_gemv(x, weight, out, PLAIN, conv=conv, prefetch=prefetch)


def _check_conv(conv: DecodeConv | None, rows: int, outputs: int) -> None:
    problem = None if conv is None else conv.problem(rows, outputs)
    if problem is not None:
        raise ValueError(problem)


def gemv_swiglu(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    prefetch: NextWeight | None = None,
) -> torch.Tensor:
    """gemv(silu_and_mul(gate_up), weight) in one kernel, with the same bits: gate_up [M, 2K] (gate
    first; any row stride, unit column stride), weight [N, K]. The activation is computed as the weight
    streams by and never written (a dense MLP's down projection at batch-1 decode)."""
    if gate_up.dim() != 2 or gate_up.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(
            f"gate_up must be (M, 2K) = (M, {2 * weight.shape[-1]}) for a weight of K = {weight.shape[-1]}, "
            f"got {tuple(gate_up.shape)}"
        )
    _check_operands(gate_up[:, : weight.shape[1]], weight, max_rows=GEMV_MAX_ROWS)
    return _launch_gemv(gate_up, weight, out, SWIGLU, prefetch=prefetch)


def gemv_sigmoid_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    prefetch: NextWeight | None = None,
) -> torch.Tensor:
    """gemv(x * sigmoid(gate), weight) in one kernel, rounded as torch rounds the two ops: x [M, H * D]
    (an attention output), gate [M, H, D] with a unit column stride (any row and head strides: the gate
    halves of q_proj's per-head [query | gate] rows), weight [N, H * D]. The gated row is never written
    (o_proj of Qwen3.5's gated attention at batch-1 decode)."""
    _check_operands(x, weight, max_rows=GEMV_MAX_ROWS)
    m, k = x.shape
    if gate.dim() != 3 or gate.shape[0] != m or gate.shape[1] * gate.shape[2] != k or gate.stride(2) != 1:
        raise ValueError(
            f"gate must be (M, H, D) with M = {m}, H * D = {k} and a unit last stride, got shape "
            f"{tuple(gate.shape)}, strides {gate.stride()}"
        )
    if gate.dtype != x.dtype:
        raise ValueError(f"gate dtype {gate.dtype} differs from x's {x.dtype}")
    return _launch_gemv(x, weight, out, SIGMOID_GATE, gate, prefetch=prefetch)


def gated_norm_problem(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor) -> str | None:
    """Why gemv_gated_norm cannot take these operands, or None."""
    if (
        x.dim() != 3
        or z.shape != x.shape
        or x.stride(2) != 1
        or z.stride(2) != 1
        or x.stride(1) != x.shape[2]
    ):
        return (
            f"x and z must be (M, H, D) of one shape with unit column strides and x's heads adjacent, got "
            f"{tuple(x.shape)} strides {x.stride()} and {tuple(z.shape)} strides {z.stride()}"
        )
    head_dim = x.shape[2]
    if head_dim & (head_dim - 1) or head_dim > GATED_NORM_MAX_HEAD_DIM:
        return f"the head dim must be a power of two <= {GATED_NORM_MAX_HEAD_DIM}, got {head_dim}"
    if norm_weight.shape != (head_dim,) or norm_weight.dtype != x.dtype or z.dtype != x.dtype:
        return (
            f"norm_weight must be ({head_dim},) and z, norm_weight of x's dtype {x.dtype}, got "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype} and z {z.dtype}"
        )
    return None


def gemv_gated_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    prefetch: NextWeight | None = None,
) -> torch.Tensor:
    """gemv(gated_rms_norm(x, z, norm_weight, eps) as [M, H * D], weight) in one kernel: x [M, H, D]
    (heads adjacent, unit column stride), z [M, H, D] (unit column stride; any row and head strides),
    norm_weight [D], weight [N, H * D]. The normed row is never written (out_proj of a Gated DeltaNet
    layer at batch-1 decode). D must be a power of two up to GATED_NORM_MAX_HEAD_DIM (whole heads in
    every K block)."""
    problem = gated_norm_problem(x, z, norm_weight)
    if problem is not None:
        raise ValueError(problem)
    m, heads, head_dim = x.shape
    rows = x.as_strided((m, heads * head_dim), (x.stride(0), 1))
    _check_operands(rows, weight, max_rows=GEMV_MAX_ROWS)
    return _launch_gemv(rows, weight, out, GATED_NORM, z, norm_weight.contiguous(), eps, prefetch=prefetch)


def _check_gate_up(weight: torch.Tensor) -> None:
    if weight.shape[0] % 2:
        raise ValueError(f"a [gate; up] weight has an even number of rows, got {weight.shape[0]}")


def gemv_swiglu_out(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    prefetch: NextWeight | None = None,
) -> torch.Tensor:
    """silu_and_mul(gemv(x, weight)) in one kernel: weight [2I, K] a SwiGLU MLP's gate_up_proj (gate rows
    first), x [M, K] (any row stride, unit column stride). Returns [M, I]: each program streams I-rows of
    both halves and writes the activation; [gate | up] is never written (a dense MLP's gate_up projection
    at batch-1 decode)."""
    _check_operands(x, weight, max_rows=GEMV_MAX_ROWS)
    _check_gate_up(weight)
    return _launch_gemv(x, weight, out, PLAIN, swiglu_out=True, prefetch=prefetch)


def gemv_rms_norm(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    swiglu_out: bool = False,
    conv: DecodeConv | None = None,
    prefetch: NextWeight | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gemv(rms_norm(h, norm_weight, eps[, residual]), weight) in one kernel: h [M, K] (any row stride,
    unit column stride), norm_weight [K] (zero-centred: the norm multiplies by 1 + norm_weight), weight
    [N, K]. Returns (y [M, N], the new residual h + residual [M, K], or None without a residual). The
    normed row is never written: each program takes the row's sum of squares, then normalises each K
    block as the weight streams by (a layer's first projection at batch-1 decode). `residual_out`
    (contiguous, apart from h and the residual) receives the sum when given. `swiglu_out`: the weight is
    a SwiGLU MLP's [gate; up] and y is silu(gate) * up, [M, N / 2] (as gemv_swiglu_out). `conv`: as
    gemv's."""
    _check_operands(h, weight, max_rows=GEMV_MAX_ROWS)
    m, k = h.shape
    if k > RMS_NORM_MAX_K:
        raise ValueError(f"gemv_rms_norm takes rows of at most {RMS_NORM_MAX_K} values, got K = {k}")
    if norm_weight.shape != (k,) or norm_weight.dtype != h.dtype:
        raise ValueError(
            f"norm_weight must be ({k},) of h's dtype {h.dtype}, got {tuple(norm_weight.shape)} "
            f"{norm_weight.dtype}"
        )
    if swiglu_out:
        _check_gate_up(weight)
        if conv is not None:
            raise ValueError("a conv applies to a Gated DeltaNet in_proj, not to a SwiGLU gate_up")
    _check_conv(conv, m, weight.shape[0])
    if residual is None:
        y = _launch_gemv(
            h,
            weight,
            out,
            RMS_NORM,
            None,
            norm_weight,
            eps,
            swiglu_out=swiglu_out,
            conv=conv,
            prefetch=prefetch,
        )
        return y, None
    if residual.shape != h.shape or residual.dtype != h.dtype or residual.stride(1) != 1:
        raise ValueError(
            f"residual must be {tuple(h.shape)} {h.dtype} with a unit column stride, got "
            f"{tuple(residual.shape)} {residual.dtype} strides {residual.stride()}"
        )
    if residual_out is None:
        residual_out = torch.empty(m, k, dtype=h.dtype, device=h.device)
    elif residual_out.shape != (m, k) or residual_out.dtype != h.dtype or not residual_out.is_contiguous():
        raise ValueError(
            f"residual_out must be a contiguous {h.dtype} tensor of shape ({m}, {k}), got "
            f"{tuple(residual_out.shape)}"
        )
    storage = residual_out.untyped_storage().data_ptr()
    if storage in (h.untyped_storage().data_ptr(), residual.untyped_storage().data_ptr()):
        raise ValueError(
            "residual_out must not share memory with h or the residual: other programs read them"
        )
    y = _launch_gemv(
        h,
        weight,
        out,
        ADD_RMS_NORM,
        None,
        norm_weight,
        eps,
        residual=residual,
        residual_out=residual_out,
        swiglu_out=swiglu_out,
        conv=conv,
        prefetch=prefetch,
    )
    return y, residual_out


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None,
    mode: int,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    swiglu_out: bool = False,
    conv: DecodeConv | None = None,
    prefetch: NextWeight | None = None,
) -> torch.Tensor:
    m, (n, k) = x.shape[0], weight.shape
    if swiglu_out:  # [gate; up] rows in, silu(gate) * up out
        n //= 2
    pf_base, pf_bytes = 0, 0
    if prefetch is not None:
        pf_bytes = prefetch_bytes(prefetch.weight, prefetch.max_bytes)
        pf_base = prefetch.weight.data_ptr() if pf_bytes else 0
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape ({m}, {n}), got {tuple(out.shape)}"
        )
    g, stride_gm, stride_gh, head_dim = (
        (x, 0, 0, 1) if gate is None else (gate, *gate.stride()[:2], gate.shape[2])
    )
    if residual is not None:  # ADD_RMS_NORM: the residual row in the gate's place
        g, stride_gm = residual, residual.stride(0)
    nw = x if norm_weight is None else norm_weight
    k_pow2 = triton.next_power_of_2(k) if mode in (RMS_NORM, ADD_RMS_NORM) else 1
    args = (
        x,
        weight,
        out,
        g,
        nw,
        out if residual_out is None else residual_out,  # written by ADD_RMS_NORM only
        out if conv is None else conv.weight,  # the conv's operands: unread without it
        out if conv is None else conv.state,
        out if conv is None else conv.slots,
        eps,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        stride_gm,
        stride_gh,
        0 if conv is None else conv.weight.shape[0],
        *((0, 0, 0, 0, 0) if conv is None else (*conv.weight.stride(), *conv.state.stride())),
        pf_base,
        pf_bytes,
    )
    if _INTERPRETER:
        block_n, block_k = _INTERPRETER_BLOCKS
        block_k = max(block_k, head_dim)
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            *args,
            ROWS=m,
            MODE=mode,
            HEAD_DIM=head_dim,
            K_POW2=k_pow2,
            SWIGLU_OUT=swiglu_out,
            CONV_KW=0 if conv is None else conv.weight.shape[1],
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PREFETCH=False,  # the interpreter runs no inline assembly; a prefetch changes no value
            PRELOAD=int(PRELOAD),
            **launch_options(x.device),
        )
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _gemv_tuned[grid](
            *args,
            ROWS=m,
            MODE=mode,
            HEAD_DIM=head_dim,
            K_POW2=k_pow2,
            SWIGLU_OUT=swiglu_out,
            CONV_KW=0 if conv is None else conv.weight.shape[1],
            PREFETCH=pf_bytes > 0,
            PRELOAD=int(PRELOAD),
            **launch_options(x.device),
        )
    return out
