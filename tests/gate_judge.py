"""The GPU gate's judge (tests/gpu/test_gate_vs_hf.py): pools the engine's log-probs against the
reference's over one surface and judges them on the gate's criteria (that module's docstring)."""

from __future__ import annotations

import torch

REGRET, MEAN, P99 = 0.2, 0.06, 0.2
NOISE_SLACK = 1.25  # judged on HF fp32, the engine may be this much further from it than HF bf16 is


class Gate:
    """Pools the comparisons of one surface and judges them at `finish`. With an fp32 truth (the bf16
    run) it also records how far the engine and HF bf16 each are from HF fp32 on the same tokens."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.diffs: list[torch.Tensor] = []
        self.ours_vs_fp32: list[torch.Tensor] = []
        self.hf_vs_fp32: list[torch.Tensor] = []
        # per compared position: (regret vs the reference, ours on fp32, HF bf16's on fp32, where)
        self.regrets: list[tuple[float, float | None, float | None, str]] = []

    def check(self, ours: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor | None, where: str) -> None:
        ours = ours.float().log_softmax(-1)
        pick = ours.argmax()
        regret = float(ref.max() - ref[pick])
        ours_true = hf_true = None
        if truth is not None:
            ours_true = float(truth.max() - truth[pick])
            hf_true = float(truth.max() - truth[ref.argmax()])
        self.regrets.append((regret, ours_true, hf_true, where))
        top = ours.topk(8).indices
        self.diffs.append((ours[top] - ref[top]).abs())
        if truth is not None:
            self.ours_vs_fp32.append((ours[top] - truth[top]).abs())
            self.hf_vs_fp32.append((ref[top] - truth[top]).abs())

    def finish(self) -> None:
        d = torch.cat(self.diffs)
        mean, p99 = float(d.mean()), float(d.quantile(0.99))
        worst = max(self.regrets)
        line = (
            f"{self.what}: top-8 |d logprob| vs the reference mean {mean:.4f} p99 {p99:.4f}, "
            f"max argmax regret {worst[0]:.3f} over {len(self.diffs)} positions"
        )
        direct_failures = [
            f"{where}: argmax regret {regret:.3f} nat"
            for regret, _, _, where in self.regrets
            if regret > REGRET
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
        for regret, ours_true, hf_true, where in self.regrets:
            if regret > REGRET and ours_true > NOISE_SLACK * max(band, hf_true):
                failures.append(
                    f"{where}: argmax {ours_true:.3f} nat from the fp32 best (HF bf16's pick "
                    f"{hf_true:.3f}, noise band {band:.3f})"
                )
        return failures
