"""Reused page-locked buffers (ops/pinned.py): the free-list policy, with a plain-memory allocator and
hand-driven copy events (the page-locked path itself runs in tests/gpu)."""

from __future__ import annotations

import torch

from deltaserve.ops.pinned import MIN_ELEMENTS, PinnedBuffers, capacity_for


class Copy:
    """A copy event the test completes by hand."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


def buffers() -> PinnedBuffers:
    return PinnedBuffers(allocate=lambda numel, dtype: torch.empty(numel, dtype=dtype))


def test_sizes_round_up_to_a_power_of_two_of_at_least_the_minimum():
    assert MIN_ELEMENTS == 256
    assert [capacity_for(n) for n in (0, 1, 256, 257, 1000, 1024, 1025)] == [
        256,
        256,
        256,
        512,
        1024,
        1024,
        2048,
    ]


def test_a_buffer_comes_back_only_once_its_copy_has_run():
    pool = buffers()
    first = pool.take(300, torch.int64)
    assert first.numel() == 512 and first.dtype == torch.int64 and pool.allocated == 1
    copy = Copy()
    pool.give_back(first, copy)
    second = pool.take(400, torch.int64)  # same size class, but the copy reading `first` is pending
    assert second.data_ptr() != first.data_ptr() and pool.allocated == 2
    copy.finished = True
    assert pool.take(500, torch.int64).data_ptr() == first.data_ptr() and pool.allocated == 2


def test_a_pending_copy_at_the_front_does_not_hold_back_the_buffers_behind_it():
    # What PyTorch's allocator does (it stops at its oldest unfinished event) and this pool must not.
    pool = buffers()
    a, b = pool.take(10, torch.int64), pool.take(10, torch.int64)
    pending, finished = Copy(), Copy()
    finished.finished = True
    pool.give_back(a, pending)
    pool.give_back(b, finished)
    assert pool.take(10, torch.int64).data_ptr() == b.data_ptr() and pool.allocated == 2


def test_two_steps_in_flight_with_drifting_sizes_settle_on_two_buffers_per_dtype():
    pool = buffers()
    copies: list[Copy] = []
    for step in range(50):  # a step's copy has run two launches later (one step launched ahead)
        if len(copies) >= 2:
            copies[-2].finished = True
        copies.append(Copy())
        pool.give_back(pool.take(120 + step, torch.int64), copies[-1])  # an upload: its copy pending
        pool.give_back(pool.take(3 * step + 1, torch.float32))  # a download read: nothing pending
    assert pool.allocated == 3  # two int64 buffers in rotation, one float32 one never pending


def test_a_buffer_first_taken_under_inference_mode_takes_writes_outside_it():
    pool = PinnedBuffers(allocate=lambda n, dtype: torch.empty(n, dtype=dtype))
    with torch.inference_mode():
        buf = pool.take(10, torch.int64)
        buf[:3].copy_(torch.arange(3))
    pool.give_back(buf)
    again = pool.take(10, torch.int64)
    assert again is buf
    again[:3].copy_(torch.arange(3, 6))  # an inference tensor would refuse this in-place write
    assert again[:3].tolist() == [3, 4, 5]
