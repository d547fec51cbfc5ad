"""The weight prefetch into L2 on the GPU: its kernel issues the bulk prefetch, and results are the same bits
with it as without it (decode kernels chained as a step chains them, eagerly and from a CUDA graph, with
PDL on; whole requests through the engine in bf16)."""

from __future__ import annotations

import pytest
import torch
from decode_chain import HIDDEN, INTER, run_chain
from llm_runs import tiny_greedy_runs

import deltaserve.ops as ops
from deltaserve.ops.triton import prefetch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)


def test_the_kernel_issues_bulk_l2_prefetches():
    w = torch.zeros(INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
    compiled = prefetch._l2_prefetch_kernel[(4,)](w.data_ptr(), 1 << 20, USE_GDC=False, num_warps=1)
    torch.cuda.synchronize()
    assert "cp.async.bulk.prefetch.L2.global" in compiled.asm["ptx"]


@pytest.mark.parametrize("graph", [False, True])
def test_decode_kernels_give_the_same_bits_with_prefetches(graph):
    assert torch.equal(run_chain(graph), run_chain(graph, prefetch_mib=16))


def _generate(mib: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[float]]]:
    monkeypatch.setattr(ops, "L2_PREFETCH_MIB", mib)
    return tiny_greedy_runs()


def test_requests_through_the_engine_are_the_same_with_prefetches(monkeypatch):
    assert _generate(0, monkeypatch) == _generate(16, monkeypatch)
