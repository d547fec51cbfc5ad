"""The conv1d, RMSNorm and SwiGLU Triton kernels against their torch references (deltaserve/ops), in
Triton's CPU interpreter without CUDA and natively with it. Every check draws fresh inputs and passes an
output buffer poisoned with NaN, so a row or column the kernel fails to write cannot pass.

bf16 results must be within one bf16 ulp of the reference everywhere and identical almost everywhere:
the kernels round where the references round, so only a different fp32 summation order (or exp) on a
rounding boundary can differ. A kernel that skips one of the reference's roundings differs by one ulp
in a large share of elements and fails the identity share.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from collections.abc import Iterable

import pytest
import torch

from deltaserve.ops import activation, conv1d, norm
from deltaserve.ops.batch import BatchRow, ForwardBatch, build_forward_batch

triton_conv = pytest.importorskip("deltaserve.ops.triton.conv1d")
triton_norm = pytest.importorskip("deltaserve.ops.triton.norm")
triton_act = pytest.importorskip("deltaserve.ops.triton.activation")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6
K = 4  # Qwen3.5's conv width


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between same-shape bf16 tensors (bit patterns mapped to a monotone line)."""

    def line(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (line(a) - line(b)).abs()


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "the kernel left poisoned (NaN) or non-finite values"
    if got.dtype == torch.bfloat16:
        ulps = bf16_ulps(got, want)
        assert ulps.max().item() <= 1, f"max {ulps.max().item()} bf16 ulps from the reference"
        identical = (ulps == 0).float().mean().item()
        assert identical >= 0.99, f"only {identical:.2%} of the values are identical to the reference"
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def make_batch(rows: list[tuple]) -> ForwardBatch:
    """rows: (new tokens, context, state slot[, state_after slots]) per sequence: decode rows first,
    then verify rows (those with state_after slots), then prefill chunks."""
    return build_forward_batch(
        [
            BatchRow([0] * n, ctx, list(range((ctx + n + 15) // 16)), slot, state_after=tuple(*after))
            for n, ctx, slot, *after in rows
        ],
        page_size=16,
        device=DEVICE,
    )


def check_conv(
    rows: list[tuple],
    channels: int,
    dtype: torch.dtype,
    seed: int,
    stale: Iterable[int] = (),
    **kernel_options: object,
) -> None:
    """Kernel vs reference on one batch: outputs, and the whole state pool after the step. x is the
    middle of a wider projection row (strided); the slots in `stale` hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(rows)
    tokens = batch.num_tokens
    x = randn(gen, tokens, channels + 40, dtype=dtype)[:, 24 : 24 + channels]
    weight = randn(gen, channels, K, dtype=dtype, scale=0.5)
    slots = [slot for _, _, slot, *after in rows for slot in (slot, *itertools.chain(*after))]
    state = randn(gen, 2 + max(slots), channels, K - 1, dtype=dtype)
    state[sorted(stale)] = float("nan")
    want_state = state.clone()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # on CUDA, a true fp32 reference
        want = conv1d.causal_conv1d(x, weight, want_state, batch)
    out = poisoned(tokens, channels, dtype=dtype)
    got = triton_conv.causal_conv1d(x, weight, state, batch, out=out, **kernel_options)
    assert_matches(got, want)
    # Every slot, the untouched and the stale ones included, equals the reference's.
    assert torch.equal(state.isnan(), want_state.isnan())
    assert torch.equal(state.nan_to_num(), want_state.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_mixed_batch_with_short_sequences_and_stale_slots(dtype):
    rows = [
        (1, 5, 3),  # decode rows first, context > 0
        (1, 1, 9),
        (1, 17, 1),
        (19, 0, 4),  # a prefill from position 0 over several token blocks; its slot is stale
        (13, 7, 2),  # a chunk continuing mid-sequence from its slot
        (1, 0, 6),  # a one-token prompt on a stale slot (context 0: the slot is never read)
        (2, 0, 11),  # shorter than K-1: the new state is zeros shifted, then the 2 inputs
        (3, 4, 12),  # exactly K-1, from the slot
        (2, 1, 5),  # shorter than K-1 with context: old columns shift left
        (1, 3, 7),
        (5, 0, 8),
    ]
    check_conv(rows, channels=300, dtype=dtype, seed=1, stale={4, 6, 11, 8})


def test_conv_short_sequences_at_every_block_offset():
    # Lengths 2, 3, 2, 1, 3 sum to 11, coprime with every power-of-two block, so over 8 cycles short
    # sequences start at every offset of an 8- or 16-row block and spill across block ends.
    lengths = [2, 3, 2, 1, 3] * 8
    contexts = itertools.cycle([0, 2, 5, 1, 0, 9, 3])
    rows = [(n, ctx, slot) for slot, (n, ctx) in enumerate(zip(lengths, contexts, strict=False), start=1)]
    check_conv(
        rows, channels=64, dtype=torch.bfloat16, seed=2, stale={slot for n, ctx, slot in rows if ctx == 0}
    )


@pytest.mark.parametrize(
    ("impl", "blocks"),
    [
        ("tiles", (4, 32, 1)),
        ("tiles", (8, 256, 4)),
        ("tiles", (32, 16, 2)),
        ("rows", (3, 32, 2, 1)),
        ("rows", (8, 16, 3, 2)),
    ],
)
def test_conv_block_shapes_agree_with_the_reference(impl, blocks):
    # Any program shape gives the reference's results: for the tile kernel, ownership of slot reads and
    # write-backs holds for any block of >= K-1 rows; for the stream kernel, any block walks its rows
    # from the K-1 rows before it. Sequences start at every offset of the blocks, some shorter than
    # K-1, some on stale slots.
    lengths = [2, 3, 2, 1, 3, 9, 1, 5] * 3
    contexts = itertools.cycle([0, 2, 5, 1, 0, 9, 3])
    rows = [(n, ctx, slot) for slot, (n, ctx) in enumerate(zip(lengths, contexts, strict=False), start=1)]
    stale = {slot for n, ctx, slot in rows if ctx == 0}
    check_conv(rows, channels=72, dtype=torch.bfloat16, seed=5, stale=stale, impl=impl, blocks=blocks)


@pytest.mark.parametrize("seq_blocks", [(32, 1), (64, 2), (128, 4)])
@pytest.mark.parametrize("decode_only", [True, False])
def test_conv_per_sequence_program_shapes_agree_with_the_reference(seq_blocks, decode_only):
    # The decode, heads and verify kernels' program shape: channel blocks that end inside the 200
    # channels, warps over fewer channels than threads; decode rows alone (the decode kernel), or beside
    # prefill chunks shorter and longer than K-1 and a verify row (heads and verify kernels).
    rows: list[tuple] = [(1, 3 + i, slot) for i, slot in enumerate([9, 2, 14, 5])]
    if not decode_only:
        rows += [(3, 4, 6, (11, 12)), (2, 0, 7), (9, 5, 8)]
    check_conv(rows, channels=200, dtype=torch.bfloat16, seed=11, stale={7}, seq_blocks=seq_blocks)


@pytest.mark.parametrize("seq_blocks", [(64,), (48, 2), (64, 3), (0, 1)])
def test_conv_per_sequence_program_shape_must_be_two_powers_of_two(seq_blocks):
    gen = torch.Generator().manual_seed(0)
    x, weight = randn(gen, 1, 32, dtype=torch.float32), randn(gen, 32, K, dtype=torch.float32)
    pool = randn(gen, 3, 32, K - 1, dtype=torch.float32)
    want = rf"seq_blocks must be \(channels per program, warps\), powers of two.*got {re.escape(str(seq_blocks))}"
    with pytest.raises(ValueError, match=want):
        triton_conv.causal_conv1d(x, weight, pool, make_batch([(1, 2, 1)]), seq_blocks=seq_blocks)


def padded(batch: ForwardBatch, empty_seqs: int, extra_tokens: int, graphed: bool) -> ForwardBatch:
    """`batch` as a CUDA-graph bucket holds it: `empty_seqs` empty sequences (the reserved slot 0, context
    0) and `extra_tokens` rows of no sequence after the live ones; `graphed` runs decode rows as varlen
    sequences (num_decodes 0), as the prefill graphs do."""
    tokens = batch.num_tokens + extra_tokens
    live = batch.query_start_loc[-1:]
    return dataclasses.replace(
        batch,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.cat([batch.query_start_loc, live.expand(empty_seqs)]),
        context_lens=torch.cat([batch.context_lens, batch.context_lens.new_zeros(empty_seqs)]),
        state_slots=torch.cat([batch.state_slots, batch.state_slots.new_zeros(empty_seqs)]),
        query_lens_host=batch.query_lens_host + (0,) * empty_seqs,
        context_lens_host=batch.context_lens_host + (0,) * empty_seqs,
        num_decodes=0 if graphed else batch.num_decodes,
    )


def random_rows(rng: random.Random, max_slot: int) -> list[tuple]:
    """A batch's rows: decode rows, then prefill chunks of 1..40 tokens (many shorter than K), from
    position 0 or continuing from a slot, each on its own slot."""
    slots = rng.sample(range(1, max_slot), 24)
    rows = [(1, rng.randint(1, 30), slots.pop()) for _ in range(rng.randint(0, 4))]
    for _ in range(rng.randint(1, 7)):
        n = rng.choice([1, 2, 3, 4, 5, rng.randint(6, 40)])
        rows.append((n, rng.choice([0, 0, rng.randint(1, 50)]), slots.pop()))
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_rows_path_is_bit_identical_to_the_tile_kernel_on_random_batches(dtype):
    # Random batches (decode rows, chunks with and without context, sequences shorter than K-1 and
    # sequences over several 1..8-row blocks, graph padding with and without decode rows), strided x,
    # stale slots, random stream blocks: outputs and state pool bit for bit those of the tile kernel,
    # padding rows unwritten, and the reference's results (bf16: exactly, under the interpreter).
    rng = random.Random(30)
    for case in range(5):
        rows = random_rows(rng, 40)
        batch = make_batch(rows)
        if case % 2:
            batch = padded(batch, rng.choice([1, 3]), rng.choice([0, 5]), graphed=case % 4 == 1)
        tokens, channels, live = batch.num_tokens, rng.choice([24, 40]), int(batch.query_start_loc[-1])
        gen = torch.Generator().manual_seed(case)
        x = randn(gen, tokens, channels + 16, dtype=dtype)[:, 8 : 8 + channels]
        weight = randn(gen, channels, K, dtype=dtype, scale=0.5)
        state = randn(gen, 40, channels, K - 1, dtype=dtype)
        state[[0, *(slot for _, ctx, slot in rows if ctx == 0)]] = float("nan")  # never read
        blocks = (rng.choice([1, 2, 3, 5, 8]), rng.choice([8, 16, 32]), rng.choice([1, 3, 4]), 1)
        results = {}
        for impl, impl_blocks in [("tiles", (4, 16, 1)), ("rows", blocks)]:
            pool = state.clone()
            out = poisoned(tokens, channels, dtype=dtype)
            triton_conv.causal_conv1d(x, weight, pool, batch, out=out, impl=impl, blocks=impl_blocks)
            results[impl] = out, pool
        (tiles_out, tiles_pool), (got, pool) = results["tiles"], results["rows"]
        assert torch.equal(got.view(torch.uint8), tiles_out.view(torch.uint8)), (case, blocks)
        assert torch.equal(pool.view(torch.uint8), tiles_pool.view(torch.uint8)), (case, blocks)
        assert got[live:].isnan().all(), "a padding row was written"
        want_pool = state.clone()
        want = conv1d.causal_conv1d(x, weight, want_pool, batch)[:live]
        assert torch.equal(pool.isnan(), want_pool.isnan())
        assert torch.equal(pool.nan_to_num(), want_pool.nan_to_num())
        if dtype == torch.bfloat16 and DEVICE.type == "cpu":
            assert torch.equal(got[:live], want)
        else:
            assert_matches(got[:live], want)


@pytest.mark.parametrize(
    ("case", "impl"),
    [("decode", "rows"), ("mixed", "rows"), ("mixed", "tiles"), ("verify", "rows"), ("verify+chunk", "rows")],
)
def test_conv_split_output_is_the_plain_outputs_column_ranges_as_contiguous_tensors(case, impl):
    # q, k and v leave the kernel as three contiguous tensors (fla would copy strided views), with the
    # bits of the plain output's column ranges, on every kernel path (decode, stream + heads, tiles,
    # verify rows with and without a chunk beside them); the state pool as the plain call leaves it.
    rows = {
        "decode": [(1, 5, 3), (1, 9, 1), (1, 2, 4)],
        "mixed": [(1, 5, 3), (19, 0, 4), (13, 7, 2), (2, 0, 5)],
        "verify": [(1, 5, 3), (4, 7, 2, (20, 21, 22)), (2, 3, 5, (23,))],
        "verify+chunk": [(1, 5, 3), (4, 7, 2, (20, 21, 22)), (11, 0, 6)],
    }[case]
    batch = make_batch(rows)
    gen = torch.Generator().manual_seed(40)
    channels, b1, b2 = 96, 16, 32
    x = randn(gen, batch.num_tokens, channels + 8, dtype=torch.bfloat16)[:, 4 : 4 + channels]
    weight = randn(gen, channels, K, dtype=torch.bfloat16, scale=0.5)
    state = randn(gen, 30, channels, K - 1, dtype=torch.bfloat16)
    blocks = (4, 32, 1) if impl == "tiles" else None
    plain_pool, split_pool = state.clone(), state.clone()
    plain = triton_conv.causal_conv1d(x, weight, plain_pool, batch, impl=impl, blocks=blocks)
    parts = triton_conv.causal_conv1d(x, weight, split_pool, batch, impl=impl, blocks=blocks, split=(b1, b2))
    assert [p.shape for p in parts] == [(batch.num_tokens, w) for w in (b1, b2 - b1, channels - b2)]
    assert all(p.is_contiguous() for p in parts)
    assert parts[1].data_ptr() == parts[0].data_ptr() + parts[0].numel() * 2  # one buffer
    for part, (lo, hi) in zip(parts, [(0, b1), (b1, b2), (b2, channels)], strict=True):
        assert torch.equal(part.view(torch.int16), plain[:, lo:hi].contiguous().view(torch.int16))
    assert torch.equal(split_pool.view(torch.int16), plain_pool.view(torch.int16))


def test_conv_split_needs_ordered_cuts_inside_the_channels_and_no_out():
    batch = make_batch([(1, 5, 3)])
    x, w, pool = (
        torch.zeros(1, 32, device=DEVICE),
        torch.zeros(32, K, device=DEVICE),
        torch.zeros(8, 32, K - 1, device=DEVICE),
    )
    for split in [(0, 8), (16, 8), (8, 32)]:
        with pytest.raises(ValueError, match=r"split .* needs 0 < b1 <= b2 < 32 channels"):
            triton_conv.causal_conv1d(x, w, pool, batch, split=split)
    with pytest.raises(ValueError, match="no `out`"):
        triton_conv.causal_conv1d(x, w, pool, batch, split=(8, 16), out=torch.zeros(1, 32, device=DEVICE))


@pytest.mark.parametrize("width", [2, 5])
def test_conv_rows_path_at_other_widths(width):
    # The window is K-1 inputs for any K: a mixed batch against the reference and the tile kernel.
    rows = [(1, 4, 1), (7, 0, 2), (1, 0, 3), (2, 3, 4), (12, 5, 5), (3, 0, 6)]
    batch = make_batch(rows)
    gen = torch.Generator().manual_seed(width)
    x = randn(gen, batch.num_tokens, 40, dtype=torch.bfloat16)[:, 4:36]
    weight = randn(gen, 32, width, dtype=torch.bfloat16, scale=0.5)
    state = randn(gen, 8, 32, width - 1, dtype=torch.bfloat16)
    state[[2, 3, 6]] = float("nan")
    got_pool, tiles_pool, want_pool = state.clone(), state.clone(), state.clone()
    got = triton_conv.causal_conv1d(x, weight, got_pool, batch, blocks=(4, 16, 2, 1))
    tiles = triton_conv.causal_conv1d(x, weight, tiles_pool, batch, impl="tiles", blocks=(4, 32, 1))
    want = conv1d.causal_conv1d(x, weight, want_pool, batch)
    assert torch.equal(got, tiles) and torch.equal(got_pool.nan_to_num(), tiles_pool.nan_to_num())
    assert_matches(got, want)
    assert torch.equal(got_pool.nan_to_num(), want_pool.nan_to_num())


def test_conv_pure_decode_batch():
    # The CUDA-graph case: every row one token with context, slots in any order.
    rows = [(1, 3 + i % 4, slot) for i, slot in enumerate([12, 1, 7, 3, 15, 2, 9, 4, 11, 5, 14])]
    check_conv(rows, channels=200, dtype=torch.bfloat16, seed=3)


def test_conv_chunked_prefill_then_decode_equals_one_pass():
    # A sequence fed as chunks of 9, 2 and 5 tokens and then 3 decode steps carries its window through
    # the slot: outputs and final state equal those of one 19-token pass.
    gen = torch.Generator().manual_seed(4)
    channels, slot, dtype = 96, 3, torch.bfloat16
    x = randn(gen, 19, channels, dtype=dtype)
    weight = randn(gen, channels, K, dtype=dtype, scale=0.5)
    state = torch.full((5, channels, K - 1), float("nan"), dtype=dtype, device=DEVICE)
    one_pass_state = state.clone()
    one_pass = triton_conv.causal_conv1d(x, weight, one_pass_state, make_batch([(19, 0, slot)]))
    pieces, done = [], 0
    for n in [9, 2, 5, 1, 1, 1]:
        batch = make_batch([(n, done, slot)])
        pieces.append(triton_conv.causal_conv1d(x[done : done + n], weight, state, batch))
        done += n
    assert torch.equal(torch.cat(pieces), one_pass)
    assert torch.equal(state[slot], one_pass_state[slot])
    assert torch.equal(state[slot], x[-(K - 1) :].t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_decodes", [False, True])
def test_conv_verify_rows_leave_the_window_after_every_token(dtype, with_decodes):
    # Decode and verify rows only: the verify kernel does the verify rows' whole step. Verify rows of
    # 2..5 tokens (some shorter than K-1), their state_after slots stale until written.
    decodes = [(1, 5, 3), (1, 1, 9)] if with_decodes else []
    verify = [(4, 7, 2, (20, 21, 22)), (2, 3, 5, (23,)), (5, 1, 4, (24, 25, 26, 27)), (3, 30, 1, (28, 29))]
    check_conv(decodes + verify, channels=300, dtype=dtype, seed=6, stale=set(range(20, 30)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_verify_rows_beside_prefill_chunks(dtype):
    # With prefill rows the verify kernel saves the inner windows first; the varlen kernel does the rest.
    rows = [(1, 5, 3), (2, 3, 5, (20,)), (4, 7, 2, (21, 22, 23)), (19, 0, 4), (1, 4, 6), (2, 1, 7)]
    check_conv(rows, channels=100, dtype=dtype, seed=7, stale={4, 20, 21, 22, 23})


def test_conv_reads_only_the_batch_device_tensors():
    # CUDA-graph safety: the host mirrors of the lengths are not used (a replay could not see them).
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([(1, 4, 2), (1, 6, 1), (6, 0, 3), (4, 2, 4)])
    x = randn(gen, batch.num_tokens, 64, dtype=torch.bfloat16)
    weight = randn(gen, 64, K, dtype=torch.bfloat16)
    state = randn(gen, 6, 64, K - 1, dtype=torch.bfloat16)
    want_state = state.clone()
    want = triton_conv.causal_conv1d(x, weight, want_state, batch)
    hostless = dataclasses.replace(batch, query_lens_host=(), context_lens_host=())
    got = triton_conv.causal_conv1d(x, weight, state, hostless)
    assert torch.equal(got, want)
    assert torch.equal(state, want_state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(10)
    x = randn(gen, 37, 300, dtype=dtype, scale=3.0)
    weight = randn(gen, 300, dtype=dtype, scale=0.1)  # zero-centred: the scale is 1 + w
    got = triton_norm.rms_norm(x, weight, EPS, out=poisoned(37, 300, dtype=dtype))
    assert_matches(got, norm.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_rounds_the_sum_first(dtype):
    gen = torch.Generator().manual_seed(11)
    x, residual = randn(gen, 21, 160, dtype=dtype), randn(gen, 21, 160, dtype=dtype, scale=4.0)
    weight = randn(gen, 160, dtype=dtype, scale=0.1)
    got, got_residual = triton_norm.rms_norm(
        x,
        weight,
        EPS,
        residual,
        out=poisoned(21, 160, dtype=dtype),
        residual_out=poisoned(21, 160, dtype=dtype),
    )
    want, want_residual = norm.rms_norm(x, weight, EPS, residual)
    assert torch.equal(got_residual, want_residual)  # one rounding of the sum: exact
    assert_matches(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    # q as the attention layer passes it: the first half of each head of the interleaved q|gate output.
    gen = torch.Generator().manual_seed(12)
    tokens, heads, head_dim = 19, 3, 64
    q = randn(gen, tokens, heads, 2 * head_dim, dtype=dtype)[..., :head_dim]
    weight = randn(gen, head_dim, dtype=dtype, scale=0.1)
    got = triton_norm.rms_norm(q, weight, EPS, out=poisoned(tokens, heads, head_dim, dtype=dtype))
    assert_matches(got, norm.rms_norm(q, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_matches_reference_with_strided_z(dtype):
    # z as the GDN layer passes it: a [T, heads, D] view of the fused in_proj output.
    gen = torch.Generator().manual_seed(13)
    tokens, heads, head_dim = 23, 5, 128
    x = randn(gen, tokens, heads, head_dim, dtype=dtype)
    z = randn(gen, tokens, heads * head_dim + 70, dtype=dtype)[:, 50 : 50 + heads * head_dim]
    z = z.reshape(tokens, heads, head_dim)
    weight = randn(gen, head_dim, dtype=dtype, scale=0.5) + 1.0
    got = triton_norm.gated_rms_norm(x, z, weight, EPS, out=poisoned(tokens, heads, head_dim, dtype=dtype))
    assert_matches(got, norm.gated_rms_norm(x, z, weight, EPS))


def test_gated_rms_norm_fp32_weight_multiplies_in_fp32():
    # torch promotes bf16 normed * fp32 weight to fp32: no rounding before the gate.
    gen = torch.Generator().manual_seed(14)
    x, z = randn(gen, 9, 4, 128, dtype=torch.bfloat16), randn(gen, 9, 4, 128, dtype=torch.bfloat16)
    weight = randn(gen, 128, dtype=torch.float32, scale=0.5) + 1.0
    got = triton_norm.gated_rms_norm(x, z, weight, EPS, out=poisoned(9, 4, 128, dtype=torch.bfloat16))
    assert_matches(got, norm.gated_rms_norm(x, z, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    # 1100 intermediate columns: more than one column block, the last ragged; rows strided.
    gen = torch.Generator().manual_seed(20)
    gate_up = randn(gen, 13, 2 * 1100 + 16, dtype=dtype, scale=2.0)[:, 8 : 8 + 2 * 1100]
    got = triton_act.silu_and_mul(gate_up, out=poisoned(13, 1100, dtype=dtype))
    assert_matches(got, activation.silu_and_mul(gate_up))


# Program shapes that do not divide the rows or columns, so each leaves a ragged last program.
@pytest.mark.parametrize("launch", [(1, 1), (4, 2), (64, 8)])
def test_norm_program_shapes_give_the_default_bits(launch):
    gen = torch.Generator().manual_seed(30)
    x, residual = randn(gen, 21, 160, dtype=torch.bfloat16), randn(gen, 21, 160, dtype=torch.bfloat16)
    weight = randn(gen, 160, dtype=torch.bfloat16, scale=0.1)
    want = triton_norm.rms_norm(x, weight, EPS, residual)
    got = triton_norm.rms_norm(
        x,
        weight,
        EPS,
        residual,
        out=poisoned(21, 160, dtype=torch.bfloat16),
        residual_out=poisoned(21, 160, dtype=torch.bfloat16),
        launch=launch,
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x3, z = randn(gen, 23, 5, 128, dtype=torch.bfloat16), randn(gen, 23, 5, 128, dtype=torch.bfloat16)
    gate_weight = randn(gen, 128, dtype=torch.bfloat16, scale=0.5) + 1.0
    got = triton_norm.gated_rms_norm(
        x3, z, gate_weight, EPS, out=poisoned(23, 5, 128, dtype=torch.bfloat16), launch=launch
    )
    assert torch.equal(got, triton_norm.gated_rms_norm(x3, z, gate_weight, EPS))


@pytest.mark.parametrize("launch", [(128, 1), (512, 4)])
def test_silu_and_mul_program_shapes_give_the_default_bits(launch):
    gen = torch.Generator().manual_seed(31)
    gate_up = randn(gen, 13, 2 * 1100, dtype=torch.bfloat16, scale=2.0)
    got = triton_act.silu_and_mul(gate_up, out=poisoned(13, 1100, dtype=torch.bfloat16), launch=launch)
    assert torch.equal(got, triton_act.silu_and_mul(gate_up))


def test_default_program_shapes_follow_the_row_count():
    # The gated norm: one head per program up to 2 x 1024 heads, then 2, 4, 8 (8 x 128 = the 1,024 tile).
    assert triton_norm._gated_launch_shape(128, 32, None) == (1, 128, 2)  # one token of 32 heads
    assert triton_norm._gated_launch_shape(128, 2047, None) == (1, 128, 2)
    assert triton_norm._gated_launch_shape(128, 2048, None) == (2, 128, 2)
    assert triton_norm._gated_launch_shape(128, 5000, None) == (4, 128, 2)
    assert triton_norm._gated_launch_shape(128, 8192 * 32, None) == (8, 128, 2)
    assert triton_norm._gated_launch_shape(256, 8192 * 32, None) == (4, 256, 2)
    assert triton_norm._gated_launch_shape(128, 8192 * 32, (16, 8)) == (16, 128, 8)
    # SwiGLU and the sigmoid gate: 256 columns until 1024-column programs cover the SMs (an H200's 132).
    assert triton_act._default_columns(1, 9216, 132) == (256, 4)  # 9 programs of 1024
    assert triton_act._default_columns(14, 9216, 132) == (256, 4)  # 126
    assert triton_act._default_columns(15, 9216, 132) == (1024, 4)  # 135
    assert triton_act._default_columns(132, 100, 132) == (1024, 4)


def test_silu_and_mul_wide_default_gives_the_narrow_bits():
    gen = torch.Generator().manual_seed(32)
    gate_up = randn(gen, 140, 2 * 600, dtype=torch.bfloat16, scale=2.0)  # 140 rows: the wide default
    got = triton_act.silu_and_mul(gate_up, out=poisoned(140, 600, dtype=torch.bfloat16))
    assert torch.equal(got, triton_act.silu_and_mul(gate_up, launch=(256, 4)))
    assert_matches(got, activation.silu_and_mul(gate_up))


@pytest.mark.parametrize("launch", [(3, 4), (4, 32), (0, 4), (4,), [4, 4]])
def test_program_shapes_that_are_not_powers_of_two_are_refused(launch):
    x = torch.ones(4, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"launch must be \(rows per program, warps\).*got"):
        triton_norm.rms_norm(x, torch.zeros(128, dtype=torch.bfloat16, device=DEVICE), EPS, launch=launch)
    with pytest.raises(ValueError, match=r"launch must be \(columns per program, warps\).*got"):
        triton_act.silu_and_mul(torch.ones(4, 256, dtype=torch.bfloat16, device=DEVICE), launch=launch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launch", [None, (128, 1)])
def test_sigmoid_gate_matches_reference_reading_the_interleaved_gate(dtype, launch):
    # The gate as the attention layer passes it: the second half of each head of the q | gate output,
    # 5 heads x 256 = 1,280 columns (two column blocks at the default, the last ragged).
    gen = torch.Generator().manual_seed(21)
    tokens, heads, head_dim = 11, 5, 256
    q_gate = randn(gen, tokens, heads, 2 * head_dim, dtype=dtype, scale=3.0)
    gate = q_gate[..., head_dim:]
    x = randn(gen, tokens, heads * head_dim + 8, dtype=dtype)[:, 8:]  # strided rows
    got = triton_act.sigmoid_gate(x, gate, out=poisoned(tokens, heads, head_dim, dtype=dtype), launch=launch)
    assert got.shape == (tokens, heads, head_dim) and got.is_contiguous()
    assert_matches(got, activation.sigmoid_gate(x, gate))


def test_sigmoid_gate_names_mismatched_operands():
    x = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(
        ValueError, match=r"x \[T, H \* D\] and gate \[T, H, D\], got \(3, 64\) and \(3, 2, 16\)"
    ):
        triton_act.sigmoid_gate(x, torch.zeros(3, 2, 16, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="one dtype, got torch.bfloat16 and torch.float32"):
        triton_act.sigmoid_gate(x, torch.zeros(3, 4, 16, device=DEVICE))
