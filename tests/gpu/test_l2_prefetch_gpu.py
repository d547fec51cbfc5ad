"""The weight prefetch into L2 on the GPU: its kernel issues the bulk prefetch, and results are the same bits
with it as without it (decode kernels chained as a step chains them, eagerly and from a CUDA graph, with
PDL on; whole requests through the engine in bf16)."""

from __future__ import annotations

import pytest
import torch

import deltaserve.ops as ops
from deltaserve.engine.llm import LLM
from deltaserve.ops.triton import activation, linear, norm, prefetch
from deltaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)

HIDDEN, INTER = 2560, 9216


def test_the_kernel_issues_bulk_l2_prefetches():
    w = torch.zeros(INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
    compiled = prefetch._l2_prefetch_kernel[(1,)](
        w.data_ptr(), 1 << 20, CHUNK=prefetch.CHUNK_BYTES, LANES=32, USE_GDC=False, num_warps=1
    )
    torch.cuda.synchronize()
    assert "cp.async.bulk.prefetch.L2.global" in compiled.asm["ptx"]


def _chain(x: torch.Tensor, w: dict[str, torch.Tensor], mib: int) -> torch.Tensor:
    """RMSNorm -> gate/up GEMV -> SiLU-and-mul -> down GEMV, each GEMV's weight prefetched ahead of the
    short kernels before it when `mib` > 0."""
    residual = x
    for _ in range(4):
        if mib:
            prefetch.prefetch_l2(w["gate_up"], mib << 20)
        h, residual = norm.rms_norm(x, w["norm"], 1e-6, residual=residual)
        gate_up = linear.gemv(h, w["gate_up"])
        if mib:
            prefetch.prefetch_l2(w["down"], mib << 20)
        x = linear.gemv(activation.silu_and_mul(gate_up), w["down"])
    return x + residual


def _run(mib: int, graph: bool) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = {
        "norm": torch.randn(HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16),
        "gate_up": torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) / 50,
        "down": torch.randn(HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16) / 100,
    }
    x = torch.randn(1, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    if not graph:
        return _chain(x, w, mib)
    _chain(x, w, mib)  # compile and tune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _chain(x, w, mib)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.parametrize("graph", [False, True])
def test_decode_kernels_give_the_same_bits_with_prefetches(graph):
    assert torch.equal(_run(0, graph), _run(16, graph))


def _generate(mib: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[float]]]:
    monkeypatch.setattr(ops, "L2_PREFETCH_MIB", mib)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(5)]
    with LLM(None, dtype="bfloat16", max_num_seqs=8, max_model_len=256) as llm:
        one = llm.generate(prompts[:1], params)
        many = llm.generate(prompts, params)
    return [(list(r.outputs[0].token_ids), [lp.logprob for lp in r.outputs[0].logprobs]) for r in one + many]


def test_requests_through_the_engine_are_the_same_with_prefetches(monkeypatch):
    assert _generate(0, monkeypatch) == _generate(16, monkeypatch)
