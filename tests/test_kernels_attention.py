"""Triton attention kernels against the torch reference (ops/attention.py, ops/norm.py, ops/rotary.py).

Runs in Triton's CPU interpreter without CUDA (tests/conftest.py) and natively where CUDA exists. Every
check draws fresh random inputs and poisons with NaN both the outputs and every KV slot no sequence
owns, so a missed store or a read outside a sequence's keys fails the comparison.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import pytest
import torch

from deltaserve.ops import attention as ref
from deltaserve.ops.batch import BatchRow, ForwardBatch, build_forward_batch
from deltaserve.ops.norm import rms_norm
from deltaserve.ops.rotary import apply_rotary, inv_frequencies, rotary_cos_sin
from deltaserve.ops.triton import attention as tri

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton's interpreter (3.6) rounds fp32 -> bf16 casts toward zero (the GPU rounds to nearest even): bf16
# tolerances cover that, and bit-level agreement is checked in the interpreter only for the q/k norm +
# RoPE kernel, whose every narrowing goes through round_to.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    # bf16 output rounding (2^-8 relative) plus the bf16 softmax weights fed to the P @ V product.
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


# ----------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class AttentionCase:
    batch: ForwardBatch
    q: torch.Tensor  # [T, heads, head_dim]
    k_cache: torch.Tensor  # [pages, page_size, kv_heads, head_dim]; NaN in every slot no row owns
    v_cache: torch.Tensor
    scale: float


def _generator(device: torch.device, *key: object) -> torch.Generator:
    """A generator seeded from the check's description: fresh inputs per check, reproducible."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(repr(key).encode()))


def make_case(
    rows: Sequence[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    padding_rows: int = 0,
    verify_rows: int = 0,
    salt: object = 0,
    device: torch.device = DEVICE,
) -> AttentionCase:
    """rows: (context_len, query_len) per sequence, decode rows (query_len 1) first, then the
    `verify_rows` verify rows (speculative decoding), then prefill chunks. Pages are drawn in shuffled
    order from 1.. (page 0 is the reserved dummy page). `padding_rows` extra decode rows of two cached
    tokens point at page 0, as CUDA-graph padding does; page 0 is then finite."""
    gen = _generator(device, rows, num_heads, num_kv_heads, head_dim, page_size, dtype, padding_rows, salt)
    needed = [-(-(ctx + n) // page_size) for ctx, n in rows]
    num_pages = sum(needed) + 4
    order = (torch.randperm(num_pages - 1, generator=gen, device=device) + 1).tolist()
    offsets = torch.arange(page_size, device=device)
    batch_rows: list[BatchRow] = []
    owned: list[torch.Tensor] = []
    num_decodes = sum(1 for _, n in rows if n == 1)
    for i, ((ctx, n), count) in enumerate(zip(rows, needed, strict=True)):
        pages, order = order[:count], order[count:]
        slots = torch.tensor(pages, device=device)[:, None] * page_size + offsets
        owned.append(slots.flatten()[: ctx + n])
        # A verify row's state slots are placeholders: attention never reads them.
        after = tuple(range(n - 1)) if num_decodes <= i < num_decodes + verify_rows else ()
        batch_rows.append(BatchRow([0] * n, context_len=ctx, pages=pages, state_slot=0, state_after=after))
    if padding_rows:
        owned.append(offsets)
        pad = BatchRow(token_ids=[0], context_len=1, pages=[0], state_slot=0)
        batch_rows[num_decodes:num_decodes] = [pad] * padding_rows
    slots = torch.cat(owned)
    caches = []
    for _ in range(2):
        cache = torch.full(
            (num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device
        )
        values = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
        cache.view(-1, num_kv_heads, head_dim)[slots] = values
        caches.append(cache)
    batch = build_forward_batch(batch_rows, page_size, device)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    return AttentionCase(batch=batch, q=q, k_cache=caches[0], v_cache=caches[1], scale=head_dim**-0.5)


def check_attention(
    case: AttentionCase, num_splits: int | None = None, kernel_batch: ForwardBatch | None = None
) -> None:
    """Kernel (on `kernel_batch`, default the case's batch) vs the reference on the case's batch."""
    out = torch.full_like(case.q, float("nan"))
    batch = case.batch if kernel_batch is None else kernel_batch
    got = tri.paged_attention(
        case.q, case.k_cache, case.v_cache, batch, case.scale, num_splits=num_splits, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    want = ref.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[case.q.dtype])


def without_host_lengths(batch: ForwardBatch) -> ForwardBatch:
    """The batch with its host length tuples emptied: what a replayed CUDA graph could not refresh."""
    return dataclasses.replace(batch, query_lens_host=(), context_lens_host=())


# ----------------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 4])
def test_decode_rows_spanning_page_boundaries_match_reference(dtype: torch.dtype, page_size: int) -> None:
    # Sequence lengths 2, page_size, page_size + 1, 2 * page_size, an odd one past three pages, 45.
    contexts = [1, page_size - 1, page_size, 2 * page_size - 1, 3 * page_size + 2, 44]
    rows = [(ctx, 1) for ctx in contexts]
    for num_splits in (1, 3, None):
        case = make_case(
            rows, num_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size, dtype=dtype, salt=num_splits
        )
        check_attention(case, num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunks_from_position_zero_and_mid_sequence_match_reference(dtype: torch.dtype) -> None:
    # A one-token prompt, chunks that start at 0, mid-page, on a page boundary, and span several tiles.
    rows = [(0, 37), (29, 21), (16, 16), (0, 1), (5, 70)]
    for page_size in (16, 4):
        case = make_case(rows, num_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size, dtype=dtype)
        check_attention(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("apart", [False, True], ids=["one-launch", "decode-apart"])
def test_mixed_batch_in_one_launch_matches_reference(dtype: torch.dtype, apart: bool, monkeypatch) -> None:
    monkeypatch.setattr(tri, "DECODE_APART_MAX_TOKENS", 1 << 30 if apart else 0)
    rows = [(40, 1), (3, 1), (16, 1), (0, 9), (33, 30), (1, 1)]
    for num_splits in (1, 4):
        case = make_case(
            rows, num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, dtype=dtype, salt=num_splits
        )
        check_attention(case, num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("apart", [False, True], ids=["one-launch", "decode-apart"])
def test_verify_rows_between_decode_rows_and_prefill_chunks_match_reference(
    dtype: torch.dtype, apart: bool, monkeypatch
) -> None:
    monkeypatch.setattr(tri, "DECODE_APART_MAX_TOKENS", 1 << 30 if apart else 0)
    # Verify rows of 2..5 tokens with context (one across a page boundary) run with the prefill rows.
    rows = [(40, 1), (3, 1), (20, 4), (7, 2), (14, 5), (30, 3), (0, 9), (33, 30)]
    for num_splits in (1, 4):
        case = make_case(
            rows,
            num_heads=6,
            num_kv_heads=2,
            head_dim=32,
            page_size=16,
            dtype=dtype,
            verify_rows=4,
            salt=num_splits,
        )
        assert (case.batch.num_decodes, case.batch.num_verify) == (2, 4)
        check_attention(case, num_splits)
    verify_only = make_case(
        rows[:6], num_heads=4, num_kv_heads=2, head_dim=32, page_size=4, dtype=dtype, verify_rows=4
    )
    check_attention(verify_only, num_splits=2, kernel_batch=without_host_lengths(verify_only.batch))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])
def test_gqa_groups_at_head_dim_256_match_reference(group: int) -> None:
    num_kv_heads = 2 if group <= 2 else 1
    rows = [(20, 1), (33, 1), (0, 5), (17, 12)]
    for dtype in DTYPES:
        case = make_case(
            rows,
            num_heads=group * num_kv_heads,
            num_kv_heads=num_kv_heads,
            head_dim=256,
            page_size=16,
            dtype=dtype,
        )
        check_attention(case, num_splits=2)


def test_shuffled_pages_and_padding_rows_on_page_zero_match_reference() -> None:
    rows = [(23, 1), (40, 1)]
    for dtype in DTYPES:
        case = make_case(
            rows, num_heads=8, num_kv_heads=2, head_dim=32, page_size=4, dtype=dtype, padding_rows=3
        )
        assert case.batch.num_decodes == 5
        check_attention(case, num_splits=1)
        check_attention(case, num_splits=3)


def test_every_split_count_gives_the_same_attention() -> None:
    # 64 splits of a 300-token context leaves most splits empty; the merge must ignore them.
    rows = [(299, 1), (130, 1), (7, 1)]
    for num_splits in (1, 2, 5, 16, 64):
        case = make_case(
            rows, num_heads=4, num_kv_heads=1, head_dim=32, page_size=16, dtype=torch.float32, salt=num_splits
        )
        check_attention(case, num_splits)


def test_kernel_reads_lengths_only_from_device_tensors() -> None:
    """A replayed CUDA graph refreshes tensors, not Python tuples: results must not depend on them."""
    for rows in ([(30, 1), (9, 1), (61, 1)], [(30, 1), (0, 20), (12, 33)]):
        case = make_case(rows, num_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32)
        check_attention(case, num_splits=2, kernel_batch=without_host_lengths(case.batch))


def as_prefill_graph_batch(batch: ForwardBatch, padding_seqs: int = 3) -> ForwardBatch:
    """The batch as a prefill graph lays it out: every row a varlen sequence (num_decodes 0), the
    count of leading decode rows in a device tensor, then `padding_seqs` empty sequences (they start
    and end at the last token, on page 0), no host lengths a replay could refresh."""
    device = batch.input_ids.device
    count = torch.tensor([batch.num_decodes], dtype=torch.int32, device=device)
    qsl = batch.query_start_loc
    return dataclasses.replace(
        without_host_lengths(batch),
        query_start_loc=torch.cat([qsl, qsl[-1:].repeat(padding_seqs)]),
        context_lens=torch.cat([batch.context_lens, batch.context_lens.new_zeros(padding_seqs)]),
        seq_lens=torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(padding_seqs)]),
        block_tables=torch.cat(
            [batch.block_tables, batch.block_tables.new_zeros(padding_seqs, batch.block_tables.shape[1])]
        ),
        state_slots=torch.cat([batch.state_slots, batch.state_slots.new_zeros(padding_seqs)]),
        num_decodes=0,
        graph_decodes=count,
        graph_chunks=len(batch.query_lens_host) - batch.num_decodes,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("apart", [False, True], ids=["one-launch", "decode-apart"])
def test_prefill_graph_batch_attends_its_decode_rows_as_decode_rows(
    dtype: torch.dtype, apart: bool, monkeypatch
) -> None:
    """With the decode rows counted on the device, a prefill graph's batch gets the bits of the same
    rows launched eagerly (decode programs, split and merged), and the reference's values; the decode
    programs past the count leave the prefill rows to the prefill programs, and the prefill tiles
    counted for the chunk rows alone cover them (empty padding sequences follow, as in a graph). The
    same with the decode rows launched apart from the prefill rows."""
    monkeypatch.setattr(tri, "DECODE_APART_MAX_TOKENS", 1 << 30 if apart else 0)
    for rows in (
        [(40, 1), (3, 1), (70, 1), (0, 9), (33, 30)],  # decode rows and chunks
        [(40, 1), (17, 1), (70, 1)],  # decode rows only
        [(0, 9), (33, 30), (5, 1)],  # no leading decode row; a one-token chunk last
    ):
        case = make_case(rows, num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, dtype=dtype, salt=2)
        graph_batch = as_prefill_graph_batch(case.batch)
        check_attention(case, num_splits=2, kernel_batch=graph_batch)
        eager = tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale, num_splits=2)
        graphed = tri.paged_attention(
            case.q, case.k_cache, case.v_cache, graph_batch, case.scale, num_splits=2
        )
        assert torch.equal(graphed, eager), rows


def test_default_split_count_follows_shapes_only() -> None:
    cpu = torch.device("cpu")  # off CUDA the rule assumes 8 SMs: it aims at 16 programs
    assert tri.decode_num_splits(0, 4, 32768, cpu) == 1
    assert tri.decode_num_splits(1, 4, 32768, cpu) == 4
    assert tri.decode_num_splits(1, 1, 32768, cpu) == 16
    assert tri.decode_num_splits(1, 1, 600, cpu) == 2  # no split shorter than MIN_SPLIT_TOKENS
    assert tri.decode_num_splits(1, 1, 100, cpu) == 1
    assert tri.decode_num_splits(16, 4, 32768, cpu) == 1  # enough programs already


def test_mismatched_cache_dtype_is_rejected_with_both_dtypes_named() -> None:
    case = make_case([(3, 1)], num_heads=2, num_kv_heads=1, head_dim=32, page_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="torch.bfloat16/torch.float32/torch.float32"):
        tri.paged_attention(case.q.bfloat16(), case.k_cache, case.v_cache, case.batch, case.scale)


# ----------------------------------------------------------------------------------------------------
# qk_norm_rope_write_kv
# ----------------------------------------------------------------------------------------------------


def reference_qk_norm_rope_write_kv(
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
) -> torch.Tensor:
    """The layer's composition (model/layers/attention.py)."""
    q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    cos, sin = rotary_cos_sin(positions, inv_freq, q.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ref.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


@dataclasses.dataclass(slots=True)
class ProjectionCase:
    q: torch.Tensor  # strided views of one fused qkv output, as the layer splits it
    k: torch.Tensor
    v: torch.Tensor
    q_norm_w: torch.Tensor
    k_norm_w: torch.Tensor
    positions: torch.Tensor
    inv_freq: torch.Tensor
    slot_mapping: torch.Tensor
    cache_shape: tuple[int, int, int, int]
    eps: float = 1e-6

    def args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        return (
            *(self.q, self.k, self.v, self.q_norm_w, self.k_norm_w, self.eps),
            *(self.positions, self.inv_freq, k_cache, v_cache, self.slot_mapping),
        )


def make_projection_case(
    positions: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    dtype: torch.dtype,
    page_size: int = 16,
    device: torch.device = DEVICE,
) -> ProjectionCase:
    tokens = len(positions)
    gen = _generator(device, positions, num_heads, num_kv_heads, head_dim, rotary_dim, dtype)
    q_size, kv_size = 2 * num_heads * head_dim, num_kv_heads * head_dim
    qkv = (3 * torch.randn(tokens, q_size + 2 * kv_size, generator=gen, device=device)).to(dtype)
    q_gate, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q_gate.view(tokens, num_heads, 2 * head_dim)[..., :head_dim]  # per head [query | gate]
    num_pages = -(-tokens // page_size) + 3
    slots = torch.randperm(num_pages * page_size, generator=gen, device=device)[:tokens]
    weights = [(0.5 * torch.randn(head_dim, generator=gen, device=device)).to(dtype) for _ in range(2)]
    return ProjectionCase(
        q=q,
        k=k.view(tokens, num_kv_heads, head_dim),
        v=v.view(tokens, num_kv_heads, head_dim),
        q_norm_w=weights[0],
        k_norm_w=weights[1],
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        inv_freq=inv_frequencies(rotary_dim, 1e7, device),
        slot_mapping=slots,
        cache_shape=(num_pages, page_size, num_kv_heads, head_dim),
    )


def check_projection(case: ProjectionCase, dtype: torch.dtype) -> None:
    caches = [torch.full(case.cache_shape, float("nan"), dtype=dtype, device=case.q.device) for _ in range(4)]
    q_out = torch.full(case.q.shape, float("nan"), dtype=dtype, device=case.q.device)
    got = tri.qk_norm_rope_write_kv(*case.args(caches[0], caches[1]), out=q_out)
    want = reference_qk_norm_rope_write_kv(*case.args(caches[2], caches[3]))
    assert got.data_ptr() == q_out.data_ptr()
    if dtype == torch.float32:
        tol = TOLERANCE[dtype]
    else:  # the reference's rounding steps: an ulp apart at most (cos/sin, summation order)
        tol = {"rtol": 2**-7, "atol": 2**-7}
    for got_t, want_t in ((got, want), (caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got_t, want_t, equal_nan=True, **tol)
    if dtype == torch.bfloat16:
        # The rounding steps are the reference's, so the values are bit-identical: on an H100, with 16 / 4
        # and 6 / 1 heads at head dim 256 and positions 0..200k, 100% of the rotated and pass-through dims
        # (docs/benchmarks/2026-12-06-h100-gate-rope-moe-tails-slots32.md). Before the fix of a
        # contracted multiply-add (one product of the rotation left unrounded in an fma.rn.bf16; the PTX
        # is checked by test_kernels_product_rounding.py), the rotated dims were 88-89% identical on an
        # H200. The bound leaves room for libdevice's cos/sin and torch's to disagree in the last bit at
        # some angle, and for the sum of squares' order to move a row's 1/rms by an fp32 ulp.
        k_got, k_want = (cache.flatten(0, 1)[case.slot_mapping] for cache in (caches[0], caches[2]))
        for got_t, want_t in ((got, want), (k_got, k_want)):
            assert (got_t == want_t).float().mean() > 0.99, "rounding steps differ from the reference"
            rotated = case.inv_freq.shape[0] * 2
            rest_got, rest_want = got_t[..., rotated:], want_t[..., rotated:]
            same = float((rest_got == rest_want).float().mean())
            assert same > 0.99, f"the norm (pass-through dims) is {same:.4f} bit-identical to the reference"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"), [(6, 1, 256, 64), (4, 2, 32, 8)]
)
def test_qk_norm_rope_write_kv_matches_reference_composition(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int
) -> None:
    # Positions from 0 to past 200k: large angles stress the fp32 cos/sin.
    case = make_projection_case(
        [0, 1, 17, 4095, 32768, 200_003],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        dtype=dtype,
    )
    assert case.q.stride(1) == 2 * head_dim  # the strided view of the fused projection
    check_projection(case, dtype)


def test_negative_slot_writes_nothing_but_still_returns_q() -> None:
    case = make_projection_case(
        [3, 9], num_heads=2, num_kv_heads=1, head_dim=32, rotary_dim=8, dtype=torch.float32
    )
    case.slot_mapping[1] = -1
    k_cache, v_cache = (torch.full(case.cache_shape, float("nan"), device=case.q.device) for _ in range(2))
    q_out = tri.qk_norm_rope_write_kv(*case.args(k_cache, v_cache))
    written = torch.isfinite(k_cache).all(dim=(-2, -1)).view(-1).nonzero().view(-1)
    assert written.tolist() == [int(case.slot_mapping[0])]
    assert torch.isfinite(v_cache).all(dim=(-2, -1)).view(-1).nonzero().view(-1).tolist() == written.tolist()
    assert torch.isfinite(q_out).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_per_token_grid_gives_the_per_head_grids_bits(dtype, monkeypatch) -> None:
    """From QK_NORM_TOKENS_PER_TOKEN_GRID tokens one program takes all of a token's heads (cos/sin once);
    the outputs, the K/V written and the padding slot left alone are those of one program per head."""
    case = make_projection_case(
        [0, 5, 17, 4095, 32768, 200_003], num_heads=6, num_kv_heads=2, head_dim=64, rotary_dim=16, dtype=dtype
    )
    case.slot_mapping[2] = -1  # padding: writes nothing in either grid

    def run() -> list[torch.Tensor]:
        caches = [
            torch.full(case.cache_shape, float("nan"), dtype=dtype, device=case.q.device) for _ in range(2)
        ]
        return [tri.qk_norm_rope_write_kv(*case.args(*caches)), *caches]

    monkeypatch.setattr(tri, "QK_NORM_TOKENS_PER_TOKEN_GRID", 10**9)
    per_head = run()
    monkeypatch.setattr(tri, "QK_NORM_TOKENS_PER_TOKEN_GRID", 1)
    per_token = run()
    for a, b in zip(per_head, per_token, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    written = int(torch.isfinite(per_token[1]).all(dim=(-2, -1)).sum())
    assert written == 5  # six tokens, one padding slot


def test_prefill_tiles_take_the_64_key_blocks_only_where_shared_memory_holds_them() -> None:
    """Head dim 256, 16-bit: the 64-key tiles need (128 + 2 stages x 2 x 64) x 256 x 2 B = 192 KiB,
    the 32-key fallback (128 + 2 x 2 x 32) x 256 x 2 B = 128 KiB."""
    assert tri.prefill_smem_bytes(tri._TILES_16BIT_MIXED, 256) == 196608
    assert tri.prefill_smem_bytes(tri._TILES_16BIT_MIXED_SMALL_SMEM, 256) == 131072
    h100_optin, a100_optin = 232448, 166912  # 227 KiB (sm_90), 163 KiB (sm_80)
    assert tri.mixed_tiles(256, h100_optin).prefill_n == 64
    assert tri.mixed_tiles(256, a100_optin).prefill_n == 32
    assert tri.mixed_tiles(128, a100_optin).prefill_n == 64  # 96 KiB at head dim 128
    assert tri.mixed_tiles(256, None).prefill_n == 64  # the interpreter has no limit


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
def test_prefill_with_the_small_shared_memory_tiles_matches_reference(dtype, monkeypatch) -> None:
    """The fallback tiles stay a tested path on GPUs where the 64-key blocks would not fit."""
    monkeypatch.setattr(tri, "_TILES_16BIT_MIXED", tri._TILES_16BIT_MIXED_SMALL_SMEM)
    rows = [(40, 1), (0, 37), (29, 21), (5, 70)]
    case = make_case(rows, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype)
    check_attention(case)
