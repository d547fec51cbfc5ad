"""DELTASERVE_SYNC_DEBUG (engine/backend.py): PyTorch's sync debug mode is on for a launch only, and
restored even when the launch fails, so the scheduler's own waits never warn."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.backend import Backend
from deltaserve.engine.step import StepPlan


def test_sync_debug_mode_covers_each_launch_and_is_always_restored(monkeypatch):
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    backend = Backend.__new__(Backend)  # no model: only launch's wrapping is under test
    backend._sync_debug = True

    def launch(plan):
        modes.append("launch")
        if plan.num_drafts:
            raise RuntimeError("a failed launch")
        return "pending"

    backend._launch = launch
    assert backend.launch(StepPlan()) == "pending"
    with pytest.raises(RuntimeError, match="a failed launch"):
        backend.launch(StepPlan(num_drafts=1))
    assert modes == ["warn", "launch", "default"] * 2
    backend._sync_debug = False  # the default: nothing switched
    backend.launch(StepPlan())
    assert modes[6:] == ["launch"]
