"""The GPU gate's judge (tests/gpu/test_gate_vs_hf.py): pools the engine's log-probs against the
reference's over one surface and judges them on the gate's criteria (that module's docstring).

A bf16 argmax that moved is judged by the errors that moved it. With `p` the engine's pick and `b`
HF fp32's best, the engine ranks p above b, so p's distance below b under fp32 is at most
|ours[b] - fp32[b]| + |ours[p] - fp32[p]|. A pick is rounding noise of HF bf16's size when both of
those errors lie within the noise band (HF bf16's p99 distance to fp32, with the same 25% slack), even
where the pick lands up to twice the band from the best; HF bf16's own picks can land there too. A pick
that one larger error moved fails, however near the best it lands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REGRET, MEAN, P99 = 0.2, 0.06, 0.2
NOISE_SLACK = 1.25  # judged on HF fp32, the engine may be this much further from it than HF bf16 is


@dataclass(frozen=True, slots=True)
class Pick:
    """One compared position's argmax. With an fp32 truth: how far below the fp32 best the engine's and
    HF bf16's picks are, and the larger of the engine's errors at its pick and at the fp32 best."""

    regret: float  # below the reference's best, under the reference
    where: str
    ours_true: float | None = None
    hf_true: float | None = None
    flip_error: float | None = None


class Gate:
    """Pools the comparisons of one surface and judges them at `finish`. With an fp32 truth (the bf16
    run) it also records how far the engine and HF bf16 each are from HF fp32 on the same tokens."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.diffs: list[torch.Tensor] = []
        self.ours_vs_fp32: list[torch.Tensor] = []
        self.hf_vs_fp32: list[torch.Tensor] = []
        self.picks: list[Pick] = []

    def check(self, ours: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor | None, where: str) -> None:
        ours = ours.float().log_softmax(-1)
        pick = ours.argmax()
        regret = float(ref.max() - ref[pick])
        if truth is None:
            self.picks.append(Pick(regret, where))
        else:
            best = truth.argmax()
            self.picks.append(
                Pick(
                    regret,
                    where,
                    ours_true=float(truth[best] - truth[pick]),
                    hf_true=float(truth[best] - truth[ref.argmax()]),
                    flip_error=float(max((ours[pick] - truth[pick]).abs(), (ours[best] - truth[best]).abs())),
                )
            )
        top = ours.topk(8).indices
        self.diffs.append((ours[top] - ref[top]).abs())
        if truth is not None:
            self.ours_vs_fp32.append((ours[top] - truth[top]).abs())
            self.hf_vs_fp32.append((ref[top] - truth[top]).abs())

    def finish(self) -> None:
        d = torch.cat(self.diffs)
        mean, p99 = float(d.mean()), float(d.quantile(0.99))
        worst = max(pick.regret for pick in self.picks)
        line = (
            f"{self.what}: top-8 |d logprob| vs the reference mean {mean:.4f} p99 {p99:.4f}, "
            f"max argmax regret {worst:.3f} over {len(self.diffs)} positions"
        )
        direct_failures = [
            f"{pick.where}: argmax regret {pick.regret:.3f} nat"
            for pick in self.picks
            if pick.regret > REGRET
        ]
        if mean > MEAN or p99 > P99:
            direct_failures.append(f"mean {mean:.4f} p99 {p99:.4f}")
        failures = direct_failures
        if direct_failures and self.ours_vs_fp32:
            failures = self._judged_on_fp32()
            o, h = torch.cat(self.ours_vs_fp32), torch.cat(self.hf_vs_fp32)
            line += (
                f"; vs HF fp32: engine mean {float(o.mean()):.4f} p99 {float(o.quantile(0.99)):.4f}, "
                f"HF bf16 mean {float(h.mean()):.4f} p99 {float(h.quantile(0.99)):.4f}"
            )
        print(line)
        assert not failures, f"{self.what}: " + "; ".join(failures)

    def _judged_on_fp32(self) -> list[str]:
        o, h = torch.cat(self.ours_vs_fp32), torch.cat(self.hf_vs_fp32)
        failures = []
        for stat, name in ((torch.mean, "mean"), (lambda t: t.quantile(0.99), "p99")):
            ours, hf = float(stat(o)), float(stat(h))
            if ours > NOISE_SLACK * hf:
                failures.append(f"{name} distance to HF fp32 {ours:.4f} > 1.25 x HF bf16's {hf:.4f}")
        band = max(REGRET, float(h.quantile(0.99)))
        for pick in self.picks:
            if pick.regret <= REGRET or pick.ours_true <= NOISE_SLACK * max(band, pick.hf_true):
                continue
            if pick.flip_error > NOISE_SLACK * band:  # module docstring: the errors that moved the pick
                failures.append(
                    f"{pick.where}: argmax {pick.ours_true:.3f} nat from the fp32 best, moved by an error of "
                    f"{pick.flip_error:.3f} nat (HF bf16's pick {pick.hf_true:.3f}, noise band {band:.3f})"
                )
        return failures
