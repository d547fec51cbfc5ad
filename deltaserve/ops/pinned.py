"""Page-locked host buffers reused step after step, for the small host<->device copies of every step
(the inputs an op or the sampler builds from host lists, a step's sampled tokens on their way back).

Why not a fresh pinned tensor each time: a page-locked allocation (cudaHostAlloc) synchronises the
device implicitly, and PyTorch's caching host allocator hands freed blocks out again only as far as
its event queue has completed, in order. With a step launched ahead, the first pending event can belong
to the step still running, so the allocator allocates anew and the launch waits for the device. Buffers here
go back to a free list of their own: an upload's once its copy has run (its event), a download's once
the host has read it. Sizes are rounded up to a power of two, so a few buffers serve every step.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

MIN_ELEMENTS = 256


class CopyDone(Protocol):
    """What marks the end of the last copy that reads a buffer (a torch.cuda.Event)."""

    def query(self) -> bool: ...


def _allocate_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def capacity_for(numel: int) -> int:
    """The buffer size that holds `numel` elements: a power of two, at least MIN_ELEMENTS."""
    return max(MIN_ELEMENTS, 1 << max(numel - 1, 0).bit_length())


class PinnedBuffers:
    """A free list of 1-D page-locked buffers per (dtype, size). Thread-safe."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor] = _allocate_pinned) -> None:
        self._allocate = allocate
        self._free: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, CopyDone | None]]] = defaultdict(
            list
        )
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated in all: a steady state allocates none

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of at least `numel` elements that no pending copy reads; allocated only when none
        of its size is free."""
        capacity = capacity_for(numel)
        with self._lock:
            free = self._free[(dtype, capacity)]
            for i, (buf, done) in enumerate(free):
                if done is None or done.query():
                    del free[i]
                    return buf
            self.allocated += 1
        # A plain tensor even when first taken under inference mode: the pool outlives the mode, and
        # an inference tensor refuses in-place writes outside it.
        with torch.inference_mode(False):
            return self._allocate(capacity, dtype)

    def give_back(self, buf: torch.Tensor, done: CopyDone | None = None) -> None:
        """Returns a buffer from `take`; `done` marks the end of the last copy that reads it (None:
        no copy is pending on it)."""
        with self._lock:
            self._free[(buf.dtype, buf.numel())].append((buf, done))

    def upload(self, data: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Host values (nested lists allowed) to `device` through a reused buffer, without waiting."""
        values = torch.tensor(data, dtype=dtype)
        buf = self.take(values.numel(), dtype)
        staged = buf[: values.numel()].view(values.shape)
        staged.copy_(values)
        out = staged.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self.give_back(buf, done)
        return out


# The process's buffers: the scheduler thread's uploads and downloads (each rank process has its own).
PINNED = PinnedBuffers()
