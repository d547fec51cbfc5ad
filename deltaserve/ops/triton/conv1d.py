"""Causal depthwise conv1d + SiLU over a varlen batch, with the per-sequence conv state, on the GPU.

Same semantics as the torch reference (deltaserve/ops/conv1d.py): a sequence's window starts from its
slot's last K-1 inputs, or from zeros when its context is 0 (the slot's stale contents are never read);
after the step the slot holds the sequence's last K-1 inputs (for a sequence shorter than K-1, old
columns shifted left, then the new inputs). The conv sum (fp32) is rounded to x's dtype before the SiLU,
as HF does, and the SiLU is rounded again. A tap's product of two bf16 values is exact in fp32 (FMA
contraction cannot change the sum), so any conv that sums its taps oldest first gives the same bits.

One call covers the whole batch, state write-back included. Nothing is read from the host copies of the
batch and every grid comes from tensor shapes, so any batch shape, the decode-only one in particular, can
be captured in a CUDA graph. A decode-only batch goes to `_conv1d_decode_kernel`, a flat grid over
(rows, channel blocks). Any other batch takes two launches (impl="rows"):
  * `_conv1d_stream_kernel` over (token blocks, channel blocks), the rows after the decode rows: each
    program walks its BLOCK_T rows in order with the last K-1 inputs in registers, so each x row is
    loaded once, and knows nothing of sequences: a row's window is simply the K-1 rows of x before it.
    That is exact for every row at least K-1 rows into its sequence, and the stream writes no state.
  * then `_conv1d_heads_kernel` over (sequences, channel blocks): each sequence's first K-1 rows, whose
    windows start in its slot (or at zeros), rewritten over the stream's values, and its slot write-back.
`_conv1d_tiles_kernel` (impl="tiles"), the earlier single-launch kernel (a [tokens, channels] tile per
program, each row binary-searching for its sequence, each tap reloading a shifted tile), computes the
same bits; it is kept as the reference the row path is checked against.

Verify rows (ForwardBatch.num_verify: context > 0, a few tokens each) also leave the window after each
of their tokens in verify_state_slots. `_conv1d_verify_kernel` walks each verify row's tokens over
(verify rows, channel blocks): it writes the windows after all but the last token into their slots,
reading only x and the row's own slot (which no other verify-row write touches). In a batch of decode
and verify rows only, it also computes the rows' outputs and then the last window into the row's slot,
beside the decode kernel over the decode rows; with prefill rows it runs first and the varlen path then
covers the verify rows as chunks with context (outputs and the last window).

Race-freedom of the in-place state update. Row path: only the heads kernel touches state, and a slot is
read and written by its sequence's programs alone (one per channel block, disjoint channels), the reads
ordered before the write-back by a barrier; a sequence's first K-1 rows are written by the stream and
then by the heads kernel, which runs after it. Tile kernel: only a sequence's first K-1 rows read its
slot, and they, together with the slot write-back, belong to the program of the token block where the
sequence starts; that program also takes those of them spilling past its block's end. Every other row
belongs to the program of its own block and reads only x. So each slot is read and written by one
program, and within it a barrier orders all reads of the slot before each write.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from deltaserve.ops.batch import ForwardBatch
from deltaserve.ops.triton.activation import round_to, silu_f32
from deltaserve.ops.triton.launch_shape import program_shape
from deltaserve.ops.triton.pdl import gdc_enter, launch_options

# The stream kernel's program: (tokens, channels, rows loaded per unrolled step, warps). The ROWS loads of
# a step are issued together (memory-level parallelism); a block re-reads the K-1 rows before it. On an
# H200 at conv_dim 8192, bf16, 2 warps beat 1 at every swept token count and batch composition (8,192
# tokens: 0.135 -> 0.116 ms; 2,048 tokens in a unified step: 0.066 -> 0.057 ms), with the same bits.
_ROW_BLOCKS = (64, 256, 8, 2)
# The tile kernel's program: (tokens, channels, warps). On an H200, for an 8192-token prefill at
# conv_dim 8192, 16 x 64 over 2 warps was the best of tokens 8..64 x channels 32..256 x warps 2..8
# (0.56 ms against 0.74 ms for 8 x 256). BLOCK_T must be >= K-1.
_TILE_BLOCKS = (16, 64, 2)
# Decode rows, and the heads and verify kernels' sequences: a flat grid over (rows or sequences, channel
# blocks); the program shape is (channels, warps). Every shape gives the same bits: each output and slot
# value is computed by one thread, in one order. On an H200 at conv_dim 8192, bf16, in CUDA graphs
# (`bench.conv1d_kernel --seq`), 256 channels on 4 warps were the best of eight shapes at 1, 64 and 226
# decode rows and in a 2,048-token unified step: 6.3 -> 5.7, 11.1 -> 10.3, 22.3 -> 19.4 and
# 57.3 -> 53.9 us against 2 warps.
_SEQ_BLOCKS = (256, 4)


@triton.jit
def conv_silu(acc, dtype: tl.constexpr):
    """silu(conv sum) in `dtype`: HF rounds the fp32 sum to the activation dtype before the SiLU."""
    y = round_to(acc, dtype).to(tl.float32)
    return round_to(silu_f32(y), dtype)


@triton.jit
def _out_offsets(rows, cols, out_rows, b1, b2, channels):
    """Offsets in `out` of (rows, cols) (rows int64). `out` holds the channel ranges [0, b1), [b1, b2)
    and [b2, channels) each as a contiguous [out_rows, width] block, so q, k and v leave the kernel as
    three contiguous tensors (b1 = b2 = channels: a plain row-major [out_rows, channels])."""
    upper = cols >= b2
    middle = cols >= b1
    seg_start = tl.where(upper, b2, tl.where(middle, b1, 0))
    seg_end = tl.where(upper, channels, tl.where(middle, b2, b1))
    return seg_start.to(tl.int64) * out_rows + rows * (seg_end - seg_start) + (cols - seg_start)


@triton.jit
def _load_taps(w_ptr, cols, cmask, stride_w_ch, stride_w_k, KW: tl.constexpr):
    """The KW taps of the channels `cols`, fp32, oldest first."""
    taps = ()
    for k in tl.static_range(KW):
        taps = taps + (
            tl.load(w_ptr + cols * stride_w_ch + k * stride_w_k, mask=cmask, other=0.0).to(tl.float32),
        )
    return taps


@triton.jit
def _locate(rows, qsl_ptr, num_seqs, num_decodes, search_steps):
    """Index of the sequence holding each row. Decode rows come first, one token each, so there
    query_start_loc[i] == i and a row is its own sequence; other rows binary-search the prefill
    sequences num_decodes..num_seqs-1 for the last start <= row (search_steps = ceil(log2(count)))."""
    is_decode = rows < num_decodes
    lo = tl.where(is_decode, rows, num_decodes)
    hi = tl.where(is_decode, rows, num_seqs - 1)
    step = 0
    while step < search_steps:  # invariant: query_start_loc[lo] <= row and the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) <= rows
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
        step += 1
    return tl.minimum(lo, num_seqs - 1)  # rows past the batch stay in range (their stores are masked)


@triton.jit
def _conv_rows(
    rows,
    seq,
    start,
    owned,
    cols,
    cmask,
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    ctx_ptr,
    slots_ptr,
    channels,
    out_rows,
    b1,
    b2,
    stride_x_tok,
    stride_w_ch,
    stride_w_k,
    stride_s_slot,
    stride_s_ch,
    stride_s_k,
    KW: tl.constexpr,
):
    """out[rows] = silu(sum_k w[:, k] * input[row - (KW-1-k)]) for the owned rows, where an input before
    the sequence's first row comes from its slot (context > 0) or is 0."""
    j = rows - start  # position of the row in this step's part of its sequence
    has_ctx = tl.load(ctx_ptr + seq) > 0
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    rows64 = rows.to(tl.int64)
    mask = owned[:, None] & cmask[None, :]
    state_row = state_ptr + slot[:, None] * stride_s_slot + cols[None, :] * stride_s_ch
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for k in tl.static_range(KW):
        d = KW - 1 - k  # tap k reads the input d rows back; summed oldest first
        wk = tl.load(w_ptr + cols * stride_w_ch + k * stride_w_k, mask=cmask, other=0.0).to(tl.float32)
        in_x = (j >= d)[:, None]
        v = tl.load(x_ptr + (rows64 - d)[:, None] * stride_x_tok + cols[None, :], mask=mask & in_x, other=0.0)
        if d > 0:
            from_slot = ((j < d) & has_ctx)[:, None]
            col = (KW - 1 + j - d)[:, None]  # slot column KW-2 is the newest input
            old = tl.load(state_row + col * stride_s_k, mask=mask & from_slot, other=0.0)
            v = tl.where(in_x, v, round_to(old.to(tl.float32), v.dtype))
        acc += wk[None, :] * v.to(tl.float32)
    y = conv_silu(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + _out_offsets(rows64[:, None], cols[None, :], out_rows, b1, b2, channels), y, mask=mask)


@triton.jit
def _write_state(
    seq,
    start,
    first,
    cols,
    cmask,
    x_ptr,
    state_ptr,
    qsl_ptr,
    ctx_ptr,
    slots_ptr,
    stride_x_tok,
    stride_s_slot,
    stride_s_ch,
    stride_s_k,
    KW: tl.constexpr,
):
    """Slot of each sequence whose first row is flagged in `first` := its last KW-1 inputs."""
    n = tl.load(qsl_ptr + seq + 1) - start
    has_ctx = tl.load(ctx_ptr + seq) > 0
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    mask = first[:, None] & cmask[None, :]
    state_row = state_ptr + slot[:, None] * stride_s_slot + cols[None, :] * stride_s_ch
    for p in tl.static_range(KW - 1):
        src = n - (KW - 1) + p  # row within the sequence whose input lands in column p; < 0: an old column
        from_x = (src >= 0)[:, None]
        src_row = (start + src).to(tl.int64)
        v = tl.load(x_ptr + src_row[:, None] * stride_x_tok + cols[None, :], mask=mask & from_x, other=0.0)
        from_slot = ((src < 0) & has_ctx)[:, None]
        old = tl.load(state_row + (p + n)[:, None] * stride_s_k, mask=mask & from_slot, other=0.0)
        v = tl.where(from_x, v, round_to(old.to(tl.float32), v.dtype))
        # Every read of these slots in this program (conv taps, older columns) is issued before this
        # barrier; columns < p are rewritten already but never read again (column p reads p + n > p).
        tl.debug_barrier()
        tl.store(
            state_row + p * stride_s_k, round_to(v.to(tl.float32), state_ptr.dtype.element_ty), mask=mask
        )


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "num_decodes", "search_steps", "out_rows"])
def _conv1d_tiles_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    qsl_ptr,
    ctx_ptr,
    slots_ptr,
    num_tokens,
    num_seqs,
    num_decodes,
    search_steps,
    channels,
    out_rows,
    b1,
    b2,
    stride_x_tok,
    stride_w_ch,
    stride_w_k,
    stride_s_slot,
    stride_s_ch,
    stride_s_k,
    KW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPILL: tl.constexpr,
):
    block_start = tl.program_id(0) * BLOCK_T
    block_end = block_start + BLOCK_T
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    total = tl.minimum(tl.load(qsl_ptr + num_seqs), num_tokens)

    # This block's rows, less the slot-reading rows of sequences that started in an earlier block.
    rows = block_start + tl.arange(0, BLOCK_T)
    seq = _locate(rows, qsl_ptr, num_seqs, num_decodes, search_steps)
    start = tl.load(qsl_ptr + seq)
    owned = (rows < total) & ((rows - start >= KW - 1) | (start >= block_start))
    _conv_rows(
        rows, seq, start, owned, cols, cmask, x_ptr, w_ptr, state_ptr, out_ptr, ctx_ptr, slots_ptr,
        channels, out_rows, b1, b2, stride_x_tok, stride_w_ch, stride_w_k, stride_s_slot, stride_s_ch,
        stride_s_k, KW,
    )  # fmt: skip

    # The spill: slot-reading rows past the block's end of sequences that start in this block.
    spill = block_end + tl.arange(0, SPILL)
    seq_s = _locate(spill, qsl_ptr, num_seqs, num_decodes, search_steps)
    start_s = tl.load(qsl_ptr + seq_s)
    owned_s = (spill < total) & (spill - start_s < KW - 1) & (start_s < block_end)
    _conv_rows(
        spill, seq_s, start_s, owned_s, cols, cmask, x_ptr, w_ptr, state_ptr, out_ptr, ctx_ptr, slots_ptr,
        channels, out_rows, b1, b2, stride_x_tok, stride_w_ch, stride_w_k, stride_s_slot, stride_s_ch,
        stride_s_k, KW,
    )  # fmt: skip

    # Write-back for the sequences starting in this block, after every read of their slots.
    _write_state(
        seq, start, (rows < total) & (rows == start), cols, cmask, x_ptr, state_ptr, qsl_ptr, ctx_ptr,
        slots_ptr, stride_x_tok, stride_s_slot, stride_s_ch, stride_s_k, KW,
    )  # fmt: skip


@triton.jit
def _stream_row(r, v, win, taps, cols, cmask, out_ptr, channels, out_rows, b1, b2, KW: tl.constexpr):
    """out[r] from win = the inputs r - (KW-1) .. r - 1 (fp32, oldest first) and v = x[r]; returns the
    window for row r + 1."""
    acc = tl.zeros([cols.shape[0]], dtype=tl.float32)
    for k in tl.static_range(KW - 1):  # summed oldest first, as the other kernels sum
        acc += taps[k] * win[k]
    x = v.to(tl.float32)
    acc += taps[KW - 1] * x
    y = conv_silu(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + _out_offsets(tl.cast(r, tl.int64), cols, out_rows, b1, b2, channels), y, mask=cmask)
    shifted = ()
    for p in tl.static_range(1, KW - 1):
        shifted = shifted + (win[p],)
    return shifted + (x,)


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "first_row", "out_rows"])
def _conv1d_stream_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    qsl_ptr,
    num_tokens,
    num_seqs,
    first_row,
    channels,
    out_rows,
    b1,
    b2,
    stride_x_tok,
    stride_w_ch,
    stride_w_k,
    KW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out of rows first_row + program_id(0) * BLOCK_T, the next BLOCK_T of them (up to the batch's
    last token), over channel block program_id(1): each row's conv from the KW-1 rows of x before it,
    whatever sequence they belong to. Exact for a row at least KW-1 rows into its sequence; the others
    are its sequence's first rows, which `_conv1d_heads_kernel` rewrites afterwards. The rows are walked
    in order with the window in registers, so each x row is loaded once (and KW-1 more per block)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    total = tl.minimum(tl.load(qsl_ptr + num_seqs), num_tokens)  # later rows are padding: not written
    block_start = first_row + tl.program_id(0) * BLOCK_T
    block_end = tl.minimum(block_start + BLOCK_T, total)
    taps = _load_taps(w_ptr, cols, cmask, stride_w_ch, stride_w_k, KW)
    # Rows before 0 are clamped to row 0: a row whose window reaches them is a first row of its sequence.
    win = ()
    for p in tl.static_range(KW - 1):
        src = tl.cast(tl.maximum(block_start - (KW - 1) + p, 0), tl.int64)
        win = win + (tl.load(x_ptr + src * stride_x_tok + cols, mask=cmask, other=0.0).to(tl.float32),)
    full = block_start + tl.maximum(block_end - block_start, 0) // ROWS * ROWS
    for base in range(block_start, full, ROWS):
        xs = ()
        for i in tl.static_range(ROWS):  # a step's loads are all issued before its first store
            xs = xs + (
                tl.load(x_ptr + tl.cast(base + i, tl.int64) * stride_x_tok + cols, mask=cmask, other=0.0),
            )
        for i in tl.static_range(ROWS):
            win = _stream_row(
                base + i, xs[i], win, taps, cols, cmask, out_ptr, channels, out_rows, b1, b2, KW
            )
    for r in range(full, block_end):
        v = tl.load(x_ptr + tl.cast(r, tl.int64) * stride_x_tok + cols, mask=cmask, other=0.0)
        win = _stream_row(r, v, win, taps, cols, cmask, out_ptr, channels, out_rows, b1, b2, KW)


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "out_rows"])
def _conv1d_heads_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    qsl_ptr,
    ctx_ptr,
    slots_ptr,
    num_tokens,
    num_seqs,
    channels,
    out_rows,
    b1,
    b2,
    stride_x_tok,
    stride_w_ch,
    stride_w_k,
    stride_s_slot,
    stride_s_ch,
    stride_s_k,
    KW: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Sequence program_id(0) over channel block program_id(1), after `_conv1d_stream_kernel`: out of
    its first KW-1 rows (their windows start in the slot, or at zeros for context 0), then its slot :=
    its last KW-1 inputs. The only program that reads or writes the slot; an empty sequence (padding)
    reads and writes nothing."""
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    x_dtype = x_ptr.dtype.element_ty
    total = tl.minimum(tl.load(qsl_ptr + num_seqs), num_tokens)
    start = tl.load(qsl_ptr + seq)
    # Per channel: Triton's interpreter combines a scalar mask with a vector one as integers.
    n = tl.load(qsl_ptr + seq + 1) - start + tl.zeros_like(cols)
    live = cmask & (n > 0)
    from_slot = live & (tl.load(ctx_ptr + seq) + tl.zeros_like(cols) > 0)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_row = state_ptr + slot * stride_s_slot + cols * stride_s_ch
    x_row = x_ptr + start.to(tl.int64) * stride_x_tok + cols
    taps = _load_taps(w_ptr, cols, cmask, stride_w_ch, stride_w_k, KW)
    # Every load first, none behind a store: the window before the step, the first KW-1 rows, and the
    # last KW-1 rows of a sequence longer than KW-1.
    win = ()
    for p in tl.static_range(KW - 1):
        old = tl.load(state_row + p * stride_s_k, mask=from_slot, other=0.0)
        win = win + (round_to(old.to(tl.float32), x_dtype),)
    heads = ()
    for j in tl.static_range(KW - 1):
        heads = heads + (tl.load(x_row + j * stride_x_tok, mask=live & (j < n), other=0.0),)
    long = n > KW - 1
    tails = ()
    for p in tl.static_range(KW - 1):
        row = (n - (KW - 1) + p).to(tl.int64)
        tails = tails + (tl.load(x_row + row * stride_x_tok, mask=live & long, other=0.0),)
    for j in tl.static_range(KW - 1):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(KW - 1):  # summed oldest first, as the other kernels sum
            acc += taps[k] * win[k].to(tl.float32)
        acc += taps[KW - 1] * heads[j].to(tl.float32)
        y = conv_silu(acc, out_ptr.dtype.element_ty)
        row = start + j + tl.zeros_like(cols)
        in_seq = j < n
        tl.store(
            out_ptr + _out_offsets(row.to(tl.int64), cols, out_rows, b1, b2, channels),
            y,
            mask=live & in_seq & (row < total),
        )
        # The window moves only within the sequence: past its end it holds the sequence's last inputs.
        shifted = ()
        for p in tl.static_range(KW - 1):
            newer = win[p + 1] if p + 1 < KW - 1 else heads[j]
            shifted = shifted + (tl.where(in_seq, newer, win[p]),)
        win = shifted
    tl.debug_barrier()  # every read of the slot above is issued before its write-back
    for p in tl.static_range(KW - 1):
        v = tl.where(long, tails[p], win[p])
        tl.store(
            state_row + p * stride_s_k, round_to(v.to(tl.float32), state_ptr.dtype.element_ty), mask=live
        )


@triton.jit(do_not_specialize=["out_rows"])
def _conv1d_decode_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    slots_ptr,
    channels,
    out_rows,
    b1,
    b2,
    stride_x_tok,
    stride_w_ch,
    stride_w_k,
    stride_s_slot,
    stride_s_ch,
    stride_s_k,
    KW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """One decode row (context > 0, one token) per program row: the window is the slot's KW-1 inputs
    then x; the slot shifts left by one and takes x. Each (row, channel) is read and written by one
    thread, so reading every column before the first write needs no barrier."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    state_row = state_ptr + slot * stride_s_slot + cols * stride_s_ch
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x_tok + cols, mask=cmask, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(KW - 1):  # oldest first, as the varlen kernel sums
        old = round_to(tl.load(state_row + k * stride_s_k, mask=cmask, other=0.0).to(tl.float32), x.dtype)
        wk = tl.load(w_ptr + cols * stride_w_ch + k * stride_w_k, mask=cmask, other=0.0).to(tl.float32)
        acc += wk * old.to(tl.float32)
    wk = tl.load(w_ptr + cols * stride_w_ch + (KW - 1) * stride_w_k, mask=cmask, other=0.0).to(tl.float32)
    acc += wk * x.to(tl.float32)
    y = conv_silu(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + _out_offsets(row.to(tl.int64), cols, out_rows, b1, b2, channels), y, mask=cmask)
    # Shift left: column p takes column p+1 (read before column p+1 is written, same thread), the
    # newest column takes x.
    for p in tl.static_range(KW - 2):
        newer = tl.load(state_row + (p + 1) * stride_s_k, mask=cmask, other=0.0)
        tl.store(state_row + p * stride_s_k, newer, mask=cmask)
    tl.store(
        state_row + (KW - 2) * stride_s_k, round_to(x.to(tl.float32), state_ptr.dtype.element_ty), mask=cmask
    )


@triton.jit
def _row_input(r, start, own_row, cols, cmask, x_ptr, stride_x_tok, stride_s_k, KW: tl.constexpr):
    """Input row `r` (int64) of the verify row whose first token is row `start`: x[r], or for r < start
    column KW-1 + (r - start) of the row's slot, rounded to x's dtype."""
    # Per channel: Triton's interpreter combines a scalar mask with a vector one as integers.
    r = r + tl.zeros_like(cols).to(tl.int64)
    in_x = r >= start
    v = tl.load(x_ptr + r * stride_x_tok + cols, mask=cmask & in_x, other=0.0)
    old = tl.load(own_row + (KW - 1 + r - start) * stride_s_k, mask=cmask & (r < start), other=0.0)
    return tl.where(in_x, v, round_to(old.to(tl.float32), v.dtype))


@triton.jit
def _verify_outputs(
    start,
    n,
    own_row,
    cols,
    cmask,
    x_ptr,
    w_ptr,
    out_ptr,
    channels,
    out_rows,
    b1,
    b2,
    stride_x_tok,
    stride_w_ch,
    stride_w_k,
    stride_s_k,
    KW: tl.constexpr,
):
    """out of the row's n tokens from row `start`: the decode kernel's sum per token, oldest tap first."""
    for i in range(0, n):
        token = start + i
        acc = tl.zeros([cols.shape[0]], dtype=tl.float32)
        for k in tl.static_range(KW):
            wk = tl.load(w_ptr + cols * stride_w_ch + k * stride_w_k, mask=cmask, other=0.0).to(tl.float32)
            # Tap k reads the input KW-1-k tokens back.
            v = _row_input(
                token - (KW - 1 - k), start, own_row, cols, cmask, x_ptr, stride_x_tok, stride_s_k, KW
            )
            acc += wk * v.to(tl.float32)
        y = conv_silu(acc, out_ptr.dtype.element_ty)
        tl.store(out_ptr + _out_offsets(token, cols, out_rows, b1, b2, channels), y, mask=cmask)


@triton.jit
def _window_to_slot(
    token,
    start,
    dst_row,
    own_row,
    cols,
    cmask,
    x_ptr,
    state_ptr,
    stride_x_tok,
    stride_s_k,
    KW: tl.constexpr,
    BARRIER: tl.constexpr,
):
    """dst column p := input row token + 1 + p - (KW-1) (the window ending at `token`). BARRIER: dst is
    the row's own slot, and each column's reads are issued before its store (column p reads column
    token - start + 1 + p > p, never one written before)."""
    for p in tl.static_range(KW - 1):
        r = token + 1 + p - (KW - 1)
        v = _row_input(r, start, own_row, cols, cmask, x_ptr, stride_x_tok, stride_s_k, KW)
        if BARRIER:
            tl.debug_barrier()
        tl.store(dst_row + p * stride_s_k, round_to(v.to(tl.float32), state_ptr.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["first_seq", "out_rows"])
def _conv1d_verify_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    qsl_ptr,
    slots_ptr,
    verify_slots_ptr,
    first_seq,
    channels,
    out_rows,
    b1,
    b2,
    stride_x_tok,
    stride_w_ch,
    stride_w_k,
    stride_s_slot,
    stride_s_ch,
    stride_s_k,
    KW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUTPUTS: tl.constexpr,
):
    """Verify row first_seq + program_id(0) over one channel block: the window after each token but the
    last into its verify slot; with OUTPUTS also the row's outputs and, after every read of the row's
    slot, its last window into that slot."""
    seq = first_seq + tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    start32 = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start32
    start = start32.to(tl.int64)
    verify_base = tl.load(qsl_ptr + first_seq)  # the verify rows' first token: verify_slots[0]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    own_row = state_ptr + slot * stride_s_slot + cols * stride_s_ch
    if OUTPUTS:
        _verify_outputs(
            start, n, own_row, cols, cmask, x_ptr, w_ptr, out_ptr, channels, out_rows, b1, b2,
            stride_x_tok, stride_w_ch, stride_w_k, stride_s_k, KW,
        )  # fmt: skip
    for i in range(0, n - 1):
        token = start + i
        dst = tl.load(verify_slots_ptr + (token - verify_base)).to(tl.int64)
        _window_to_slot(
            token, start, state_ptr + dst * stride_s_slot + cols * stride_s_ch, own_row, cols, cmask,
            x_ptr, state_ptr, stride_x_tok, stride_s_k, KW, False,
        )  # fmt: skip
    if OUTPUTS:
        tl.debug_barrier()  # every read of the row's slot above is issued before its first store
        _window_to_slot(
            start + n - 1, start, own_row, own_row, cols, cmask, x_ptr, state_ptr, stride_x_tok, stride_s_k,
            KW, True,
        )  # fmt: skip


def _decode_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    out: torch.Tensor,
    batch: ForwardBatch,
    rows: int,
    channels: int,
    strides: tuple[int, ...],
    width: int,
    layout: tuple[int, int, int],
    seq_blocks: tuple[int, int],
) -> None:
    """The decode kernel over the batch's first `rows` rows (decode rows: one token each)."""
    block_c, num_warps = seq_blocks
    _conv1d_decode_kernel[(rows, triton.cdiv(channels, block_c))](
        x,
        weight,
        conv_state,
        out,
        batch.state_slots,
        channels,
        *layout,
        *strides,
        KW=width,
        BLOCK_C=block_c,
        num_warps=num_warps,
        **launch_options(x.device),
    )


def _varlen_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    out: torch.Tensor,
    batch: ForwardBatch,
    strides: tuple[int, ...],
    blocks: tuple[int, int, int, int],
    layout: tuple[int, int, int],
    seq_blocks: tuple[int, int],
) -> None:
    """The stream kernel over the rows after the decode rows, then the heads kernel over every sequence."""
    tokens, channels = x.shape
    block_t, block_c, rows, num_warps = blocks
    num_seqs = batch.state_slots.shape[0]
    nd = batch.num_decodes  # rows 0..nd-1, one token each: the heads kernel writes all of them
    if tokens > nd:
        _conv1d_stream_kernel[(triton.cdiv(tokens - nd, block_t), triton.cdiv(channels, block_c))](
            x,
            weight,
            out,
            batch.query_start_loc,
            tokens,
            num_seqs,
            nd,
            channels,
            *layout,
            *strides[:3],
            KW=weight.shape[1],
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            ROWS=rows,
            num_warps=num_warps,
        )
    seq_c, seq_warps = seq_blocks
    _conv1d_heads_kernel[(num_seqs, triton.cdiv(channels, seq_c))](
        x,
        weight,
        conv_state,
        out,
        batch.query_start_loc,
        batch.context_lens,
        batch.state_slots,
        tokens,
        num_seqs,
        channels,
        *layout,
        *strides,
        KW=weight.shape[1],
        BLOCK_C=seq_c,
        num_warps=seq_warps,
    )


def _varlen_tiles(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    out: torch.Tensor,
    batch: ForwardBatch,
    strides: tuple[int, ...],
    blocks: tuple[int, int, int],
    layout: tuple[int, int, int],
) -> None:
    """The tile kernel over the whole batch."""
    tokens, channels = x.shape
    block_t, block_c, num_warps = blocks
    num_seqs = batch.state_slots.shape[0]
    num_prefills = num_seqs - batch.num_decodes
    width = weight.shape[1]
    _conv1d_tiles_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
        x,
        weight,
        conv_state,
        out,
        batch.query_start_loc,
        batch.context_lens,
        batch.state_slots,
        tokens,
        num_seqs,
        batch.num_decodes,
        (num_prefills - 1).bit_length() if num_prefills > 0 else 0,
        channels,
        *layout,
        *strides,
        KW=width,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        SPILL=triton.next_power_of_2(width - 1),
        num_warps=num_warps,
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    batch: ForwardBatch,
    *,
    out: torch.Tensor | None = None,
    blocks: tuple[int, ...] | None = None,
    impl: Literal["rows", "tiles"] = "rows",
    split: tuple[int, int] | None = None,
    seq_blocks: tuple[int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, C] (rows may be strided, e.g. the qkv part of the fused in_proj output); weight: [C, K];
    conv_state: [slots, C, K-1], updated in place at batch.state_slots (and, for the windows after a
    verify row's tokens, at batch.verify_state_slots). Returns silu(conv(x)) [T, C] in
    x's dtype, written into `out` when given (contiguous). Reads only the batch's device tensors.
    `split` = (b1, b2): instead, the channel ranges [0, b1), [b1, b2) and [b2, C) as three contiguous
    tensors of one buffer (q, k and v, which fla's kernels would otherwise copy to contiguous ones).
    `impl` picks the path of batches with prefill rows: "rows" (the stream and heads kernels, the
    default) or "tiles" (the earlier tile kernel, the same bits). `blocks`, a tuning knob, is the
    program shape of its main kernel: (tokens, channels, rows loaded per step, warps) for "rows",
    (tokens, channels, warps) for "tiles", where tokens must be >= K-1. `seq_blocks`, another, is the
    program shape of the per-row and per-sequence kernels (decode rows, the heads kernel, verify rows):
    (channels, warps). None: the module defaults."""
    tokens, channels = x.shape
    if impl not in ("rows", "tiles"):
        raise ValueError(f"impl must be 'rows' or 'tiles', got {impl!r}")
    if blocks is None:
        blocks = _ROW_BLOCKS if impl == "rows" else _TILE_BLOCKS
    if len(blocks) != (4 if impl == "rows" else 3):
        raise ValueError(f"blocks {blocks} do not fit impl {impl!r}")
    seq_blocks = program_shape(seq_blocks, _SEQ_BLOCKS, "channels", field="seq_blocks")
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"conv weight has shape {tuple(weight.shape)}, expected ({channels}, K)")
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"conv kernel width {width} is below 2 (linear_conv_kernel_dim)")
    if impl == "tiles" and width > blocks[0] + 1:
        raise ValueError(f"the tile kernel needs blocks of >= K-1 tokens, got {blocks[0]} for K = {width}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (channels, width - 1):
        raise ValueError(
            f"conv_state has shape {tuple(conv_state.shape)}, expected (slots, {channels}, {width - 1})"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    if split is not None:
        b1, b2 = split
        if out is not None or not 0 < b1 <= b2 < channels:
            raise ValueError(f"split {split} needs 0 < b1 <= b2 < {channels} channels and no `out`")
        out = torch.empty(tokens * channels, dtype=x.dtype, device=x.device)
    elif out is None:
        out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, channels) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {(tokens, channels)}")
    layout = (tokens, channels, channels) if split is None else (tokens, *split)
    _run_kernels(x, weight, conv_state, batch, out, blocks, impl, layout, seq_blocks)
    if split is None:
        return out
    b1, b2 = split
    return (
        out[: tokens * b1].view(tokens, b1),
        out[tokens * b1 : tokens * b2].view(tokens, b2 - b1),
        out[tokens * b2 :].view(tokens, channels - b2),
    )


def _run_kernels(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    batch: ForwardBatch,
    out: torch.Tensor,
    blocks: tuple[int, ...],
    impl: Literal["rows", "tiles"],
    layout: tuple[int, int, int],
    seq_blocks: tuple[int, int],
) -> None:
    """`layout` = (out_rows, b1, b2): where each output lands (_out_offsets)."""
    tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = batch.state_slots.shape[0]
    nd, nv = batch.num_decodes, batch.num_verify
    if tokens == 0 or num_seqs == 0:
        return
    # x row, weight channel/tap, state slot/channel/column strides: the same for every kernel.
    strides = (x.stride(0), weight.stride(0), weight.stride(1), *conv_state.stride())
    if nv == 0 and nd == num_seqs == tokens:
        _decode_rows(x, weight, conv_state, out, batch, nd, channels, strides, width, layout, seq_blocks)
        return
    if nv > 0:
        # Without prefill rows the verify kernel does the verify rows' whole step; with them it only
        # saves the windows after their inner tokens, before the varlen kernel rewrites their slots.
        whole = nd + nv == num_seqs
        if whole and nd > 0:
            _decode_rows(x, weight, conv_state, out, batch, nd, channels, strides, width, layout, seq_blocks)
        _conv1d_verify_kernel[(nv, triton.cdiv(channels, seq_blocks[0]))](
            x,
            weight,
            conv_state,
            out,
            batch.query_start_loc,
            batch.state_slots,
            batch.verify_state_slots,
            nd,
            channels,
            *layout,
            *strides,
            KW=width,
            BLOCK_C=seq_blocks[0],
            OUTPUTS=whole,
            num_warps=seq_blocks[1],
        )
        if whole:
            return
    if impl == "tiles":
        _varlen_tiles(x, weight, conv_state, out, batch, strides, blocks, layout)
        return
    _varlen_rows(x, weight, conv_state, out, batch, strides, blocks, layout, seq_blocks)
