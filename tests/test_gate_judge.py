"""The GPU gate's judge on hand-made log-probs (tests/gate_judge.py): a bf16 argmax that moves within
the noise band passes, one moved by an error beyond it fails, and the absolute criteria decide alone
when there is no fp32 truth."""

from __future__ import annotations

import pytest
import torch
from gate_judge import Gate

VOCAB = 16


def log_probs(probs: dict[int, float]) -> torch.Tensor:
    """The log-probs of a distribution over the listed tokens (the others ~1e-13 each)."""
    x = torch.full((VOCAB,), -30.0)
    for token, p in probs.items():
        x[token] = torch.tensor(p).log()
    return x


QUIET = log_probs({0: 0.5, 1: 0.3, 2: 0.2})


def bf16_gate(truth: torch.Tensor, ours: torch.Tensor) -> Gate:
    """200 positions where the engine equals fp32 and HF bf16 (the reference) is 0.5 nat off on one
    top-8 token in every ten: its p99 distance to fp32, the noise band, is 0.5 nat. Then the position
    under test, where HF bf16 picked the fp32 best."""
    gate = Gate("bf16 test surface")
    noisy = QUIET.clone()
    noisy[2] += 0.5
    for i in range(200):
        gate.check(QUIET, noisy if i % 10 == 0 else QUIET, QUIET, f"position {i}")
    gate.check(ours, truth.clone(), truth, "the position under test")
    return gate


# fp32: token 0 is best, token 1 ln(0.45 / 0.2) = 0.811 nat below it: past 1.25 x the band (0.625).
FAR = log_probs({0: 0.45, 1: 0.2, 3: 0.35})


def test_a_pick_moved_by_two_errors_within_the_band_passes():
    # The engine picks 1, moved by errors of ln(0.45 / 0.33) = 0.310 at token 0 and ln(0.34 / 0.2) =
    # 0.531 at token 1: each within 1.25 x the band.
    bf16_gate(FAR, log_probs({0: 0.33, 1: 0.34, 3: 0.33})).finish()


def test_a_pick_moved_by_one_error_beyond_the_band_fails():
    # The same pick, moved by one error of ln(0.46 / 0.2) = 0.833 nat at token 1 (none at token 0).
    with pytest.raises(AssertionError, match="0.811 nat from the fp32 best, moved by an error of 0.833 nat"):
        bf16_gate(FAR, log_probs({0: 0.45, 1: 0.46, 3: 0.09})).finish()


def test_a_pick_within_the_band_of_the_best_passes_whatever_moved_it():
    # Token 1 is ln(0.45 / 0.25) = 0.588 nat below the best: within 1.25 x the band, so a pick of it
    # passes, even moved by an error of ln(0.46 / 0.25) = 0.610 at it alone.
    near = log_probs({0: 0.45, 1: 0.25, 3: 0.30})
    bf16_gate(near, log_probs({0: 0.45, 1: 0.46, 3: 0.09})).finish()


def test_a_surface_farther_from_fp32_than_hf_bf16_fails_on_its_distances():
    gate = bf16_gate(FAR, log_probs({0: 0.33, 1: 0.34, 3: 0.33}))
    off = QUIET.clone()
    off[2] += 1.5
    for i in range(50):  # now the engine, not HF bf16, is 1.5 nat off on one top-8 token, often
        gate.check(off, QUIET, QUIET, f"extra {i}")
    with pytest.raises(AssertionError, match="distance to HF fp32"):
        gate.finish()


def test_without_an_fp32_truth_an_argmax_beyond_the_bound_fails():
    gate = Gate("fp32 test surface")
    ref = log_probs({0: 0.5, 1: 0.37, 2: 0.13})
    gate.check(log_probs({0: 0.37, 1: 0.5, 2: 0.13}), ref, None, "position 0")
    with pytest.raises(AssertionError, match=r"position 0: argmax regret 0\.301 nat"):
        gate.finish()
