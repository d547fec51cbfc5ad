"""Decode kernels chained as a decode step chains them, for GPU tests that compare two settings of a
switch which must change no value: RMSNorm -> gate/up GEMV -> SiLU-and-mul -> down GEMV -> residual
RMSNorm, 4 times over, eagerly or replayed from a CUDA graph."""

from __future__ import annotations

import torch

from deltaserve.ops.triton import activation, linear, norm, prefetch

HIDDEN, INTER = 2560, 9216


def _chain(x: torch.Tensor, w: dict[str, torch.Tensor], prefetch_mib: int) -> torch.Tensor:
    """With `prefetch_mib`, each GEMV prefetches the next one's weight into L2 as it ends (the first from
    a kernel of its own), as a decode step does."""

    def then(weight: torch.Tensor) -> linear.NextWeight | None:
        return linear.NextWeight(weight, prefetch_mib << 20) if prefetch_mib else None

    if prefetch_mib:
        prefetch.prefetch_l2(w["gate_up"], prefetch_mib << 20)
    residual = x
    for _ in range(4):
        h, residual = norm.rms_norm(x, w["norm"], 1e-6, residual=residual)
        gate_up = linear.gemv(h, w["gate_up"], prefetch=then(w["down"]))
        x = linear.gemv(activation.silu_and_mul(gate_up), w["down"], prefetch=then(w["gate_up"]))
    return x + residual


def run_chain(graph: bool, prefetch_mib: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = {
        "norm": torch.randn(HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16),
        "gate_up": torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) / 50,
        "down": torch.randn(HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16) / 100,
    }
    x = torch.randn(1, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    if not graph:
        return _chain(x, w, prefetch_mib)
    _chain(x, w, prefetch_mib)  # compile and tune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _chain(x, w, prefetch_mib)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return out.clone()
