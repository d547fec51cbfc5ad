"""Fresh prefill chunks through torch's SDPA (ops/fresh_attention.py, cuDNN on CUDA) beside the paged
kernel: which sequences take it, the paged kernel limited to the others, and the two together against the
torch reference. Lengths and buckets are scaled down (the interpreter runs the paged kernel on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_attention import DEVICE, TOLERANCE, make_case

from deltaserve.ops import attention as ref
from deltaserve.ops import fresh_attention as fresh
from deltaserve.ops.triton import attention as tri

SHAPE = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "page_size": 4}


def _batch(rows: list[tuple[int, int]]):
    return make_case(rows, dtype=torch.float32, **SHAPE).batch


@pytest.mark.parametrize(
    ("rows", "first"),
    [
        ([(20, 1), (7, 1), (100, 40), (0, 40), (0, 32)], 3),  # decode rows, a chunk after context, 2 fresh
        ([(0, 40), (5, 40)], None),  # the last chunk has context
        ([(0, 31), (0, 40)], 1),  # a fresh chunk below the minimum stays on the paged kernel
        ([(0, 40), (0, 33)], 0),  # every sequence
        ([(20, 1), (0, 31)], None),
        ([(20, 1), (7, 1)], None),  # decode rows only
    ],
)
def test_the_fresh_tail_is_the_trailing_run_of_long_chunks_from_position_0(rows, first):
    assert fresh.fresh_tail(_batch(rows), min_tokens=32) == first


def test_a_graphs_batch_never_takes_the_fresh_path():
    batch = _batch([(0, 40)])
    graph = dataclasses.replace(batch, graph_decodes=torch.zeros(1, dtype=torch.int32), graph_chunks=1)
    assert fresh.fresh_tail(graph, min_tokens=32) is None


def test_bucket_lengths_are_the_next_multiple_of_the_bucket():
    assert [fresh.bucket_length(n) for n in (1, 512, 513, 2048, 2049)] == [512, 512, 1024, 2048, 2560]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_paged_kernel_limited_to_the_first_sequences_leaves_the_others_rows(dtype):
    case = make_case([(20, 1), (9, 1), (30, 17), (0, 40), (0, 33)], dtype=dtype, **SHAPE)
    whole = tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    out = torch.full_like(case.q, float("nan"))
    tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale, out=out, seqs=3)
    limited_rows = 1 + 1 + 17
    assert torch.equal(out[:limited_rows], whole[:limited_rows])
    assert out[limited_rows:].isnan().all()
    with pytest.raises(ValueError, match="seqs 1 outside"):
        tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale, seqs=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_then_fresh_chunks_equal_the_reference(dtype, monkeypatch):
    """Decode rows, a chunk after context and three fresh chunks (the first below the minimum) of lengths
    off the bucket: each fresh chunk padded to the bucket, only its own rows written."""
    monkeypatch.setattr(fresh, "BUCKET", 16)
    rows = [(20, 1), (9, 1), (30, 17), (0, 20), (0, 40), (0, 33)]
    case = make_case(rows, dtype=dtype, **SHAPE)
    first = fresh.fresh_tail(case.batch, min_tokens=32)
    assert first == 4
    out = tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale, seqs=first)
    fresh.attend_fresh(case.q, case.k_cache, case.v_cache, case.batch, case.scale, first, out)
    want = ref.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCE[dtype])


def test_warm_up_runs_every_bucket_up_to_the_step_budget(monkeypatch):
    lengths = []
    monkeypatch.setattr(fresh, "_dense", lambda q, k, v, scale: lengths.append(q.shape[0]))
    assert fresh.warm_plans(4, 2, 32, torch.float32, DEVICE, max_tokens=4096) == 5
    assert lengths == [2048, 2560, 3072, 3584, 4096]
    assert fresh.warm_plans(4, 2, 32, torch.float32, DEVICE, max_tokens=4095) == 5  # 4095 pads to 4096
    assert fresh.warm_plans(4, 2, 32, torch.float32, DEVICE, max_tokens=2047) == 0  # no chunk takes the path


def test_only_16bit_activations_take_the_path_and_only_when_switched_on(monkeypatch):
    monkeypatch.setattr(fresh, "ENABLED", True)
    assert fresh.applies(torch.bfloat16) and fresh.applies(torch.float16) and not fresh.applies(torch.float32)
    monkeypatch.setattr(fresh, "ENABLED", False)
    assert not fresh.applies(torch.bfloat16)
