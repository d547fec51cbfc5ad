"""Programmatic dependent launch on the GPU: the same bits with it as without it.

Every kernel launched with PDL waits for the kernel before it at its first statement, so its results equal
a plain launch's exactly. Checked on the decode kernels chained as a decode step chains them, eagerly and
replayed from a CUDA graph (the graph keeps the programmatic edges), and on whole requests through the
engine in bf16 (decode graphs, one and several rows)."""

from __future__ import annotations

import pytest
import torch
from decode_chain import run_chain
from llm_runs import tiny_greedy_runs

from deltaserve.ops.triton import pdl

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)


def _run(enabled: bool, graph: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(pdl, "ENABLED", enabled)
    return run_chain(graph)


@pytest.mark.parametrize("graph", [False, True])
def test_decode_kernels_give_the_same_bits_with_pdl(graph, monkeypatch):
    plain = _run(False, graph, monkeypatch)
    with_pdl = _run(True, graph, monkeypatch)
    assert torch.equal(plain, with_pdl)


def _generate(enabled: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[float]]]:
    monkeypatch.setattr(pdl, "ENABLED", enabled)
    return tiny_greedy_runs()


def test_requests_through_the_engine_are_the_same_with_pdl(monkeypatch):
    assert _generate(False, monkeypatch) == _generate(True, monkeypatch)
