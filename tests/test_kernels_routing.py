"""The routing kernel against the torch reference (`route` in deltaserve/ops/moe.py), in Triton's CPU
interpreter without CUDA and natively with it: the same experts in the same order, weights within one
rounding of the dtype (the fp32 softmax sums in another order)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import moe

tri = pytest.importorskip("deltaserve.ops.triton.routing")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def logits_of(tokens: int, experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct values in every row, exact in bf16 (a tie's order is unspecified in torch.topk): integers
    of magnitude <= 256 over a power of two, in [-8, 8)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** max(0, (experts - 1).bit_length() - 4)
    rows = [(torch.randperm(experts, generator=gen) - experts // 2) / scale for _ in range(tokens)]
    return (torch.stack(rows) if tokens else torch.zeros(0, experts)).to(dtype).to(DEVICE)


def assert_routes_like_the_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    weights, ids = tri.route(logits, top_k, renormalize)
    want_weights, want_ids = moe.route(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == logits.dtype
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    tol = 1e-6 if logits.dtype == torch.float32 else 8e-3  # one bf16 rounding
    torch.testing.assert_close(weights.float(), want_weights.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"),
    [(1, 8, 2), (37, 8, 2), (5, 256, 8), (40, 256, 8), (3, 6, 6), (17, 512, 10), (2, 1, 1)],
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_reference(dtype, tokens, experts, top_k, renormalize) -> None:
    assert_routes_like_the_reference(logits_of(tokens, experts, dtype, seed=tokens), top_k, renormalize)


def test_strided_rows_and_no_tokens() -> None:
    wide = logits_of(9, 40, torch.bfloat16, seed=2)
    assert_routes_like_the_reference(wide[:, 4:36], 4, True)  # row stride 40, 32 experts
    weights, ids = tri.route(logits_of(0, 8, torch.bfloat16, seed=0), 2, True)
    assert weights.shape == ids.shape == (0, 2)


def test_a_tie_goes_to_the_lower_expert() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0]], device=DEVICE)
    weights, ids = tri.route(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 3, 4]]
    assert weights[0, 0] == weights[0, 1]


def test_extreme_logits_stay_finite() -> None:
    logits = torch.tensor([[-1e4, 60.0, 0.0, 50.0], [-30.0, -30.0, -30.0, -29.0]], device=DEVICE)
    weights, ids = tri.route(logits, 2, renormalize=True)
    want_weights, want_ids = moe.route(logits, 2, renormalize=True)
    assert torch.isfinite(weights).all()
    assert ids[0].tolist() == want_ids[0].tolist() and ids[1, 0] == 3
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's numpy max
def test_a_row_of_nan_logits_gets_valid_expert_ids_and_leaves_the_other_rows_alone() -> None:
    """The expert kernels index weights by id unchecked: a NaN row must not send an id out of range."""
    logits = logits_of(3, 8, torch.bfloat16, seed=4)
    logits[1, 5] = float("nan")
    weights, ids = tri.route(logits, 2, renormalize=True)
    assert ((ids >= 0) & (ids < 8)).all()
    assert torch.isnan(weights[1]).all()
    want_weights, want_ids = moe.route(logits, 2, renormalize=True)
    for row in (0, 2):
        assert torch.equal(ids[row], want_ids[row]) and torch.equal(weights[row], want_weights[row])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x: x[0], "expected 2-D"),
        (lambda x: x.to(torch.int32), "dtype"),
    ],
)
def test_bad_inputs_are_rejected_naming_the_argument(change, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tri.route(change(logits_of(3, 8, torch.float32, seed=1)), 2, True)
    with pytest.raises(ValueError, match="top_k must be in"):
        tri.route(logits_of(3, 8, torch.float32, seed=1), 9, True)
