"""Programmatic dependent launch on the GPU: the same bits with it as without it.

Every kernel launched with PDL waits for the kernel before it at its first statement, so its results equal
a plain launch's exactly. Checked on the decode kernels chained as a decode step chains them, eagerly and
replayed from a CUDA graph (the graph keeps the programmatic edges), and on whole requests through the
engine in bf16 (decode graphs, one and several rows)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.ops.triton import activation, linear, norm, pdl
from deltaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)

HIDDEN, INTER = 2560, 9216


def _chain(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """RMSNorm -> gate/up GEMV -> SiLU-and-mul -> down GEMV -> residual RMSNorm, 4 times over."""
    residual = x
    for _ in range(4):
        h, residual = norm.rms_norm(x, w["norm"], 1e-6, residual=residual)
        x = linear.gemv(activation.silu_and_mul(linear.gemv(h, w["gate_up"])), w["down"])
    return x + residual


def _run(enabled: bool, graph: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(pdl, "ENABLED", enabled)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = {
        "norm": torch.randn(HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16),
        "gate_up": torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) / 50,
        "down": torch.randn(HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16) / 100,
    }
    x = torch.randn(1, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    if not graph:
        return _chain(x, w)
    _chain(x, w)  # compile and tune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _chain(x, w)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.parametrize("graph", [False, True])
def test_decode_kernels_give_the_same_bits_with_pdl(graph, monkeypatch):
    plain = _run(False, graph, monkeypatch)
    with_pdl = _run(True, graph, monkeypatch)
    assert torch.equal(plain, with_pdl)


def _generate(enabled: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[float]]]:
    monkeypatch.setattr(pdl, "ENABLED", enabled)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(5)]
    with LLM(None, dtype="bfloat16", max_num_seqs=8, max_model_len=256) as llm:
        one = llm.generate(prompts[:1], params)
        many = llm.generate(prompts, params)
    return [(list(r.outputs[0].token_ids), [lp.logprob for lp in r.outputs[0].logprobs]) for r in one + many]


def test_requests_through_the_engine_are_the_same_with_pdl(monkeypatch):
    assert _generate(False, monkeypatch) == _generate(True, monkeypatch)
