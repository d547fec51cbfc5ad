"""The batch-1 decode fusions of the GEMV (DELTASERVE_FUSED_GEMV) and its weight preload, compiled, in the
model on the GPU: the 4B shape cut to four layers (three Gated DeltaNet, one attention), three decode
steps after a two-token prompt, each setting against the plain kernels. The CPU tests check the
wiring with references standing in for the kernels, and the kernels in the interpreter at small shapes;
this is the compiled kernels at the real widths (K = 2560 takes a ragged last block of 1,024), in the
order a step runs them, with their conv windows carried from step to step.

The GEMV's block shape is pinned to one config for every run here: the autotuner tunes each variant
apart (its key holds the mode, the conv and the preload), and a variant that wins with another block
shape sums in another order, a bf16 step off in the logits (0.047 for the conv on an H100) with no fault
in the fusion. One shape for all makes "the same bits" a statement about the fusion alone. K = 2560
over blocks of 1,024 keeps the ragged last block."""

from __future__ import annotations

import pytest
import torch
from decode_row import after_two_tokens

import deltaserve.ops as ops
from deltaserve.ops.batch import BatchRow

triton_linear = pytest.importorskip("deltaserve.ops.triton.linear")
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def one_block_shape():
    """The tuned block shape with K blocks of 1,024 (one config: the autotuner runs it without timing)."""
    tuned = triton_linear._gemv_tuned
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tuned, "configs", [next(c for c in tuned.configs if c.kwargs["BLOCK_K"] == 1024)])
        yield


def _decode_logits(monkeypatch: pytest.MonkeyPatch, fusions: set[str], preload: bool = True) -> torch.Tensor:
    """[STEPS, vocab] logits of three decode steps of one sequence with `fusions` on."""
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset(fusions))
    monkeypatch.setattr(triton_linear, "PRELOAD", preload)
    torch.manual_seed(0)
    backend, row = after_two_tokens(
        "4b-shape", torch.bfloat16, 0.2, device=torch.device("cuda"), layers=4, fan_in=True
    )
    steps = [
        backend.logits([BatchRow([7 + i], row.context_len + i, row.pages, row.state_slot)])[0]
        for i in range(STEPS)
    ]
    return torch.stack(steps).float()


@pytest.fixture(scope="module")
def plain() -> torch.Tensor:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _decode_logits(monkeypatch, set())


@pytest.mark.parametrize("fusions", [{"swiglu_out"}, {"conv"}, {"gate"}], ids=lambda f: ",".join(sorted(f)))
def test_a_fusion_that_keeps_the_bits_gives_the_plain_logits(plain, fusions, monkeypatch):
    fused = _decode_logits(monkeypatch, fusions)
    assert torch.equal(fused, plain), f"max |diff| {(fused - plain).abs().max().item():.4g} per step"


@pytest.mark.parametrize(
    "fusions", [{"rmsnorm"}, {"rmsnorm", "swiglu_out", "conv"}], ids=lambda f: ",".join(sorted(f))
)
def test_the_input_norm_in_the_gemv_stays_within_a_bf16_step_of_the_plain_logits(plain, fusions, monkeypatch):
    """The fused norm's sum of squares may add in another order: a normalised value one bf16 step off,
    which moves a logit by far less than the logits' spread; a wrong residual or norm moves them by it."""
    fused = _decode_logits(monkeypatch, fusions)
    spread = plain.std(dim=1, keepdim=True)
    worst = ((fused - plain).abs() / spread).max().item()
    assert worst < 0.05, f"a logit moved by {worst:.3f} of the logits' spread"


def test_the_weight_preload_gives_the_same_logits(plain, monkeypatch):
    assert torch.equal(_decode_logits(monkeypatch, set(), preload=False), plain)
