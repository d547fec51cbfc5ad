"""Triton attention kernels at real Qwen3.5 shapes on CUDA, in bf16 and fp32, against the torch reference;
CUDA-graph capture and replay of the decode step; and `bench_attention()`, a micro-benchmark (not a test):

    python tests/gpu/test_kernels_attention_gpu.py        # prints decode GB/s and prefill TFLOP/s

Shapes: 4B has 16 query / 4 kv heads, 27B 24 / 4; head_dim 256, rotary_dim 64, page size 16.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the case builders live in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402
from test_kernels_attention import (  # noqa: E402
    DTYPES,
    TOLERANCE,
    AttentionCase,
    check_attention,
    check_projection,
    make_case,
    make_projection_case,
    reference_qk_norm_rope_write_kv,
)

from deltaserve.ops import attention as ref  # noqa: E402
from deltaserve.ops.batch import ForwardBatch  # noqa: E402
from deltaserve.ops.rotary import inv_frequencies  # noqa: E402
from deltaserve.ops.triton import attention as tri  # noqa: E402

SHAPES = {"4B": (16, 4), "27B": (24, 4)}  # (query heads, kv heads)
HEAD_DIM = 256
PAGE_SIZE = 16


def _contexts(count: int, high: int, seed: int) -> list[int]:
    """Random contexts in [1, high) with the page-boundary cases mixed in."""
    gen = torch.Generator().manual_seed(seed)
    edge = [1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, high - 1]
    drawn = torch.randint(1, high, (count,), generator=gen).tolist()
    return (edge + drawn)[:count] if count > len(edge) else drawn


def _case(rows: list[tuple[int, int]], shape: str, dtype: torch.dtype, **kwargs: object) -> AttentionCase:
    num_heads, num_kv_heads = SHAPES[shape]
    return make_case(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        page_size=PAGE_SIZE,
        dtype=dtype,
        device=torch.device("cuda"),
        **kwargs,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch_size", [1, 2, 7, 32, 128, 256])
def test_decode_batches_up_to_8k_context_match_reference(
    dtype: torch.dtype, shape: str, batch_size: int
) -> None:
    rows = [(ctx, 1) for ctx in _contexts(batch_size, 8192, seed=batch_size)]
    check_attention(_case(rows, shape, dtype, padding_rows=2 if batch_size > 2 else 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_4096_token_prefill_chunk_after_4097_token_context_matches_reference(
    dtype: torch.dtype, shape: str
) -> None:
    check_attention(_case([(4097, 4096)], shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_of_decode_rows_and_chunks_matches_reference(dtype: torch.dtype) -> None:
    rows = [(ctx, 1) for ctx in _contexts(40, 8192, seed=3)] + [(0, 1000), (517, 333), (2048, 1)]
    for num_splits in (None, 1, 6):
        check_attention(_case(rows, "27B", dtype, salt=num_splits), num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_contexts_give_the_same_attention_for_every_split_count(dtype: torch.dtype) -> None:
    rows = [(32767, 1), (20000, 1), (5, 1)]
    for num_splits in (None, 1, 7, 64):
        check_attention(_case(rows, "4B", dtype, salt=num_splits), num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_qk_norm_rope_write_kv_at_27b_shape_matches_reference(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 262_144, (tokens,), generator=gen).tolist()
    num_heads, num_kv_heads = SHAPES["27B"]
    case = make_projection_case(
        positions,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        rotary_dim=64,
        dtype=dtype,
        device=torch.device("cuda"),
    )
    check_projection(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_replayed_from_a_cuda_graph_with_new_lengths_and_pages(dtype: torch.dtype) -> None:
    """Capture qk_norm_rope_write_kv + paged_attention with one set of lengths and block tables, replay
    with another (incl. padding rows on page 0): the replay must match the reference on the new batch."""
    num_heads, num_kv_heads = SHAPES["27B"]
    max_pages = 8192 // PAGE_SIZE  # the bucket's fixed block-table width: the max-context bound
    case = _case([(ctx, 1) for ctx in (1, 15, 16, 300, 4097, 8190)], "27B", dtype, padding_rows=2)
    batch, rows = case.batch, case.batch.num_seqs
    k_start, v_start = case.k_cache.clone(), case.v_cache.clone()
    gen = torch.Generator(device="cuda").manual_seed(11)
    cuda = torch.device("cuda")

    # Static inputs, first holding unrelated lengths, pages and slots for the capture.
    positions = torch.randint(0, max_pages * PAGE_SIZE - 1, (rows,), generator=gen, device=cuda)
    static = ForwardBatch(
        input_ids=batch.input_ids.clone(),
        positions=positions,
        query_start_loc=batch.query_start_loc.clone(),
        context_lens=positions.int(),
        seq_lens=(positions + 1).int(),
        block_tables=torch.randint(
            0, case.k_cache.shape[0], (rows, max_pages), generator=gen, device=cuda, dtype=torch.int32
        ),
        slot_mapping=torch.randint(0, case.k_cache.shape[0] * PAGE_SIZE, (rows,), generator=gen, device=cuda),
        state_slots=batch.state_slots.clone(),
        logits_indices=batch.logits_indices.clone(),
        num_decodes=rows,
        query_lens_host=(1,) * rows,
        context_lens_host=tuple(positions.tolist()),
    )
    q_size, kv_size = 2 * num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
    qkv = torch.randn(rows, q_size + 2 * kv_size, generator=gen, device=cuda).to(dtype)
    q_norm_w, k_norm_w = (0.5 * torch.randn(2, HEAD_DIM, generator=gen, device=cuda)).to(dtype)
    inv_freq = inv_frequencies(64, 1e7, cuda)

    def views() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_gate, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q_gate.view(rows, num_heads, 2 * HEAD_DIM)[..., :HEAD_DIM]
        return q, k.view(rows, num_kv_heads, HEAD_DIM), v.view(rows, num_kv_heads, HEAD_DIM)

    q_out = torch.empty(rows, num_heads, HEAD_DIM, dtype=dtype, device=cuda)
    out = torch.empty_like(q_out)

    def step() -> None:
        q, k, v = views()
        args = (q_norm_w, k_norm_w, 1e-6, static.positions, inv_freq, case.k_cache, case.v_cache)
        tri.qk_norm_rope_write_kv(q, k, v, *args, static.slot_mapping, out=q_out)
        tri.paged_attention(q_out, case.k_cache, case.v_cache, static, case.scale, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles every kernel variant outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # Replay on the real batch: new lengths, pages, slots, positions and activations.
    static.positions.copy_(batch.positions)
    static.seq_lens.copy_(batch.seq_lens)
    static.block_tables.zero_()
    static.block_tables[:, : batch.block_tables.shape[1]].copy_(batch.block_tables)
    static.slot_mapping.copy_(batch.slot_mapping)
    qkv.copy_(torch.randn(qkv.shape, generator=gen, device=cuda).to(dtype))
    case.k_cache.copy_(k_start)
    case.v_cache.copy_(v_start)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    q_ref = reference_qk_norm_rope_write_kv(
        *views(), q_norm_w, k_norm_w, 1e-6, batch.positions, inv_freq, k_start, v_start, batch.slot_mapping
    )
    want = ref.paged_attention(q_ref, k_start, v_start, batch, case.scale)
    # The padding rows both write page 0, offset 1 (whichever store lands last wins, in the kernel and
    # in the reference alike), so their outputs and page 0 are garbage by design: compare the rest.
    real = rows - 2
    torch.testing.assert_close(out[:real].float(), want[:real].float(), **TOLERANCE[dtype])
    cache_tol = TOLERANCE[torch.float32] if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(case.k_cache[1:], k_start[1:], equal_nan=True, **cache_tol)
    torch.testing.assert_close(case.v_cache[1:], v_start[1:], equal_nan=True, **cache_tol)


# ----------------------------------------------------------------------------------------------------
# Micro-benchmark (the lead calls it; not collected as a test)
# ----------------------------------------------------------------------------------------------------


def bench_attention(dtype: torch.dtype = torch.bfloat16, max_cached_tokens: int = 1 << 21) -> None:
    """Prints decode bandwidth (K/V bytes read + q/out, per second) and prefill causal TFLOP/s."""
    from triton.testing import do_bench

    elem = torch.empty((), dtype=dtype).element_size()
    for shape, (num_heads, num_kv_heads) in SHAPES.items():
        for batch_size in (1, 8, 32, 64, 128, 256):
            for context in (1024, 4096, 8192, 32768):
                if batch_size * context > max_cached_tokens:
                    continue
                case = _case([(context - 1, 1)] * batch_size, shape, dtype)
                splits = tri.decode_num_splits(
                    batch_size, num_kv_heads, case.batch.block_tables.shape[1] * PAGE_SIZE, case.q.device
                )
                ms = do_bench(lambda c=case: tri.paged_attention(c.q, c.k_cache, c.v_cache, c.batch, c.scale))
                kv_bytes = 2 * batch_size * context * num_kv_heads * HEAD_DIM * elem
                io_bytes = 2 * case.q.numel() * elem
                print(
                    f"{shape} decode  B={batch_size:<4} ctx={context:<6} splits={splits:<3} "
                    f"{ms * 1e3:9.1f} us  {(kv_bytes + io_bytes) / ms / 1e6:8.0f} GB/s"
                )
                del case
        for context, chunk in ((0, 4096), (4097, 4096), (0, 16384)):
            case = _case([(context, chunk)], shape, dtype)
            ms = do_bench(lambda c=case: tri.paged_attention(c.q, c.k_cache, c.v_cache, c.batch, c.scale))
            # QK^T and PV: 4 * head_dim flops per (query head, visible key) pair.
            pairs = chunk * context + chunk * (chunk + 1) // 2
            flops = 4 * num_heads * HEAD_DIM * pairs
            print(
                f"{shape} prefill ctx={context:<6} chunk={chunk:<6} {ms * 1e3:9.1f} us "
                f"{flops / ms / 1e9:8.1f} TFLOP/s"
            )
            del case
        rows = [(4095, 1)] * 64 + [(0, 2048)]
        case = _case(rows, shape, dtype)
        ms = do_bench(lambda c=case: tri.paged_attention(c.q, c.k_cache, c.v_cache, c.batch, c.scale))
        print(f"{shape} mixed   64 decode rows @4k + 2048-token chunk {ms * 1e3:9.1f} us")
        del case
        for tokens in (256, 4096):
            proj = make_projection_case(
                list(range(tokens)),
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=HEAD_DIM,
                rotary_dim=64,
                dtype=dtype,
                device=torch.device("cuda"),
            )
            k_cache = torch.empty(proj.cache_shape, dtype=dtype, device="cuda")
            v_cache = torch.empty_like(k_cache)
            ms = do_bench(lambda p=proj, k=k_cache, v=v_cache: tri.qk_norm_rope_write_kv(*p.args(k, v)))
            moved = tokens * (2 * num_heads + 4 * num_kv_heads) * HEAD_DIM * elem  # q in/out, k/v in/out
            print(
                f"{shape} qk_norm_rope_write_kv T={tokens:<5} {ms * 1e3:9.1f} us {moved / ms / 1e6:8.0f} GB/s"
            )


if __name__ == "__main__":
    bench_attention()
