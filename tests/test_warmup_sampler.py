"""The start-up warm-up takes every stage of the sampler (engine/warmup.py): under load, a kernel's
first launch in the process waits for the queued work, so none may be left for serving to launch first."""

from __future__ import annotations

import torch

from deltaserve.engine import sampler as sampler_module
from deltaserve.engine.sampler import Sampler
from deltaserve.engine.warmup import warm_sampler


def test_the_sampler_warm_up_takes_every_stage_at_each_row_count(monkeypatch):
    seen: list[tuple[str, int]] = []

    def recording(name, fn, detail=lambda *a, **k: ""):
        def wrapper(*args, **kwargs):
            seen.append((name + detail(*args, **kwargs), args[0].shape[0]))
            return fn(*args, **kwargs)

        return wrapper

    output_counts = sampler_module._output_counts

    def counting(prows, *args, **kwargs):
        where = " on the device" if any(r.penalty_slot is not None for r in prows) else ""
        seen.append(("_output_counts" + where, len(prows)))
        return output_counts(prows, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "_output_counts", counting)
    for name in ("_apply_penalties", "_gumbel_argmax", "logprobs_of"):
        monkeypatch.setattr(sampler_module, name, recording(name, getattr(sampler_module, name)))
    monkeypatch.setattr(
        sampler_module,
        "_top_k_top_p_",
        recording(
            "top_k_top_p",
            sampler_module._top_k_top_p_,
            lambda scores, top_k, top_p, **k: " full sort" if not k["all_top_k"] and k["any_top_p"] else "",
        ),
    )
    argmax = torch.Tensor.argmax
    monkeypatch.setattr(
        torch.Tensor,
        "argmax",
        lambda self, *a, **k: seen.append(("argmax", self.shape[0])) or argmax(self, *a, **k),
    )
    rng = torch.get_rng_state()
    warm_sampler(Sampler(), vocab=64, device=torch.device("cpu"), max_rows=12)
    assert torch.equal(torch.get_rng_state(), rng)  # no random stream moved
    for rows in (1, 8, 12):
        stages = {name for name, n in seen if n == rows}
        assert stages >= {
            "_apply_penalties",
            "_output_counts",
            "_output_counts on the device",
            "_gumbel_argmax",
            "logprobs_of",
            "top_k_top_p",
            "top_k_top_p full sort",
            "argmax",
        }, rows
    assert {n for _, n in seen} >= {1, 8, 12}  # and the sampled rows of the mixed steps (6 and 9)
