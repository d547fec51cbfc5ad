"""DELTASERVE_MEMORY_HISTORY's summary: the device allocations made while serving, by the innermost
deltaserve frame, read from the allocator snapshot's traces (hand-made here in PyTorch's format)."""

from __future__ import annotations

import pickle

from deltaserve.memory_history import AllocationSite, main, serving_allocations

SAMPLER = {"filename": "/site/deltaserve/engine/sampler.py", "line": 120, "name": "process_logits"}
TORCH = {"filename": "/site/torch/nn/functional.py", "line": 9, "name": "linear"}
MODEL = {"filename": "/site/deltaserve/model/qwen35.py", "line": 170, "name": "compute_logits"}


def entry(action: str, size: int = 0, frames: list | None = None) -> dict:
    return {"action": action, "addr": 0, "size": size, "stream": 0, "frames": frames or []}


SNAPSHOT = {
    "segments": [],
    "device_traces": [
        [
            entry("segment_alloc", 100 << 20, [TORCH, MODEL]),  # start-up: not counted
            entry("snapshot"),  # serving starts
            entry("alloc", 4 << 20, [SAMPLER]),  # served from the cache: not a device allocation
            entry("segment_alloc", 4 << 20, [SAMPLER]),
            entry("segment_alloc", 6 << 20, [TORCH, MODEL]),
            entry("segment_alloc", 8 << 20, [SAMPLER]),
            entry("segment_alloc", 2 << 20, [TORCH]),
        ]
    ],
}


def test_allocations_after_serving_starts_by_their_innermost_deltaserve_frame() -> None:
    assert serving_allocations(SNAPSHOT) == [
        AllocationSite("deltaserve/engine/sampler.py:120(process_logits)", 2, 12 << 20),
        AllocationSite("deltaserve/model/qwen35.py:170(compute_logits)", 1, 6 << 20),
        AllocationSite("functional.py:9(linear)", 1, 2 << 20),
    ]


def test_a_trace_without_a_serving_mark_counts_whole() -> None:
    trace = [e for e in SNAPSHOT["device_traces"][0] if e["action"] != "snapshot"]
    assert sum(s.count for s in serving_allocations({"device_traces": [trace]})) == 5


def test_the_module_prints_the_summary_of_a_written_file(tmp_path, capsys) -> None:
    path = tmp_path / "history.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "4 device allocations while serving" in out and "sampler.py:120(process_logits)" in out
