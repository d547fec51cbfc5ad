"""Counters of the allocations that can stall a step launched ahead: a new CUDA segment (cudaMalloc),
an allocation retry (the caching allocator frees its cached blocks, which synchronises the device),
and page-locked host memory (cudaHostAlloc synchronises implicitly), ours (ops/pinned.py) and
PyTorch's caching host allocator's.

For the step log (DELTASERVE_ITL_DEBUG) only: reading them costs tens of microseconds.
"""

from __future__ import annotations

import torch

from deltaserve.ops.pinned import PINNED

COUNTERS = ("cuda_malloc", "alloc_retry", "host_alloc", "pinned")


def allocation_counts() -> dict[str, int]:
    """Running totals per COUNTERS name (the CUDA ones 0 where CUDA is not initialised here)."""
    counts = dict.fromkeys(COUNTERS, 0)
    counts["pinned"] = PINNED.allocated
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        counts["cuda_malloc"] = stats.get("num_device_alloc", 0)
        counts["alloc_retry"] = stats.get("num_alloc_retries", 0)
        host_stats = getattr(torch.cuda, "host_memory_stats", None)
        if host_stats is not None:
            counts["host_alloc"] = host_stats().get("num_host_alloc", 0)
    return counts


def counts_since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that moved between two readings, by how much."""
    return {name: after[name] - before[name] for name in COUNTERS if after[name] != before[name]}
