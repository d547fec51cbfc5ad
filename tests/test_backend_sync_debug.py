"""DELTASERVE_SYNC_DEBUG (engine/backend.py): PyTorch's sync debug mode is on for a launch only, and
restored even when the launch fails, so the scheduler's own waits never warn. The streams a launch
runs on with prefill overlap."""

from __future__ import annotations

import contextlib

import pytest
import torch

from deltaserve.engine.backend import Backend, OverlapStreams
from deltaserve.engine.step import PendingStep, StepPlan


def test_sync_debug_mode_covers_each_launch_and_is_always_restored(monkeypatch):
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    backend = Backend.__new__(Backend)  # no model: only launch's wrapping is under test
    backend._sync_debug, backend._streams, backend._time_steps = True, None, False

    def launch(plan, decode_graphs=True):
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


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        self.log.append(f"{self.name} synchronized")


class _Event:
    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, stream: _Stream) -> None:
        self.log.append(f"finished recorded on {stream.name}")


def test_with_overlap_an_async_prefill_runs_on_the_prefill_stream_after_what_was_launched(monkeypatch):
    """Every launch runs on the main stream but an overlapped one, which waits for the main stream
    (its inputs), runs on the prefill stream without decode graphs, and records the event the
    scheduler waits for before its requests go back to the main stream."""
    log: list = []
    streams = OverlapStreams(_Stream("main", log), _Stream("prefill", log))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(log.append(f"on {s.name}")))
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(log))
    backend = Backend.__new__(Backend)  # no model: only the stream routing is under test
    backend._sync_debug, backend._streams, backend._time_steps = False, streams, False

    def launch(plan, decode_graphs=True):
        log.append(f"launch, decode graphs {decode_graphs}")
        if plan.force_accept:
            raise torch.OutOfMemoryError("a launch that fails part-way")
        return PendingStep(None, None, [])

    backend._launch = launch
    assert backend.launch(StepPlan()).finished is None
    assert log == ["on main", "launch, decode graphs True"]
    log.clear()
    assert isinstance(backend.launch(StepPlan(), overlapped=True).finished, _Event)
    assert log == [
        "prefill waits for main",
        "on prefill",
        "launch, decode graphs False",
        "finished recorded on prefill",
    ]
    log.clear()
    # A failed overlapped launch drains what it queued before the scheduler releases its rows' caches.
    with pytest.raises(torch.OutOfMemoryError):
        backend.launch(StepPlan(force_accept=True), overlapped=True)
    assert log == [
        "prefill waits for main",
        "on prefill",
        "launch, decode graphs False",
        "prefill synchronized",
    ]
    log.clear()
    backend._streams = None  # overlap off (or CPU): one stream, in launch order
    assert backend.launch(StepPlan(), overlapped=True).finished is None
    assert log == ["launch, decode graphs False"]
