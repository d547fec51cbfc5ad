"""A step's [rows, vocab] temporaries, allocated at a power-of-two row count.

The sampler's temporaries (a float32 copy of the logits, penalty counts, scaled scores, a sort, noise) hold
about 1 MB per row over Qwen3.5's vocabulary. PyTorch's caching allocator serves a request only from a
cached block at least as large, so a temporary sized by a row count that grows by a few rows each step
(a server filling up) takes a new device allocation every step and leaves each smaller block cached
beside it: the cache fragments until an allocation fails, and the allocator then frees all of it at a
device synchronisation, a stall of every running stream (allocator retries of 134 and 193 ms in a
35B-A3B saturated run, docs/benchmarks/2026-12-04-h200-saturated-defaults.md). Allocated at the row
count rounded up to a power of two, a growing batch takes a new block only when it doubles, and any
smaller batch reuses the cached one. Only the first `rows` rows are ever read or written.
"""

from __future__ import annotations

import torch


def padded_rows(rows: int) -> int:
    """The power of two at or above `rows` (0 for 0)."""
    return 0 if rows <= 0 else 1 << (rows - 1).bit_length()


def row_buffer(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised [rows, cols] tensor: the first rows of a [padded_rows(rows), cols] allocation."""
    return torch.empty((padded_rows(rows), cols), dtype=dtype, device=device)[:rows]
