"""Reused page-locked buffers on the GPU: uploads and step results stay exact, and neither waits for
the device while it is busy (what a step launched ahead needs)."""

from __future__ import annotations

import time

import torch

from deltaserve.engine.step import StagedResult
from deltaserve.ops.batch import to_device
from deltaserve.ops.pinned import PINNED


def _busy_device(ms: float) -> None:
    """Queues roughly `ms` of work on the current stream."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    started = time.monotonic()
    a @ a
    torch.cuda.synchronize()
    once = max(time.monotonic() - started, 1e-4)
    for _ in range(int(ms / 1e3 / once) + 1):
        a = a @ a / 4096


def test_uploads_and_step_results_are_exact_and_reuse_their_buffers():
    device = torch.device("cuda")
    for step in range(20):
        rows = [[step, i, -i] for i in range(100 + step)]
        assert to_device(rows, torch.int64, device).tolist() == rows
        tokens = torch.arange(100 + step, device=device) * 7
        sampled = torch.linspace(-1, 0, 100 + step, device=device)
        ranks = torch.arange(100 + step, device=device) % 3
        top_ids, top_lps = tokens.view(-1, 1).repeat(1, 2), sampled.view(-1, 1).repeat(1, 2)
        staged = StagedResult.start([tokens, sampled, ranks, top_ids, top_lps])
        staged.done.synchronize()
        assert [t.tolist() for t in staged.tensors] == [
            t.tolist() for t in (tokens, sampled, ranks, top_ids, top_lps)
        ]
        assert staged.read([]).token_ids == tokens.tolist()
    allocated = PINNED.allocated
    for step in range(20):
        to_device(list(range(150 + step)), torch.int64, device)
        StagedResult.start([torch.arange(150 + step, device=device)]).read([])
    torch.cuda.synchronize()
    assert PINNED.allocated == allocated  # the steady state allocates nothing


def test_neither_waits_for_a_busy_device():
    device = torch.device("cuda")
    # Buffers for what is below to exist before the device is busy, as serving's first steps leave them.
    held = [PINNED.take(256, torch.int64) for _ in range(12)] + [
        PINNED.take(512, torch.int64) for _ in range(4)
    ]
    for buf in held:
        PINNED.give_back(buf)
    allocated = PINNED.allocated
    _busy_device(300)
    started = time.monotonic()
    for step in range(8):  # uploads and downloads queued behind ~300 ms of work, none of it run yet
        to_device(list(range(200 + 10 * step)), torch.int64, device)
        StagedResult.start([torch.arange(200 + 10 * step, device=device)])
    host_ms = (time.monotonic() - started) * 1e3
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy and host_ms < 50, f"{host_ms:.1f} ms on the host while the device was busy"
    assert PINNED.allocated == allocated
