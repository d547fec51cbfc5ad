"""GDN state snapshots for the prefix cache: the device pool and the table of what each holds.

A snapshot is a copy of one sequence's conv window and SSM state (at the live state's dtype) after
exactly `position` tokens. With the KV of those tokens (the full pages, found by their keys, and a copy
of the partial page at the boundary, `tail_page`) it lets a later sequence with the same prefix resume
there: a hybrid model's cached prefix is only reusable where both exist (KV alone would miss the
recurrent state). Snapshots live in their own pool, sized at start-up; an unreferenced one is evicted
least recently used when a new one needs its place. A snapshot is in the table only once the step that
writes it has been launched, so a lookup never finds a half-written one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


class StateSnapshots:
    """Device memory: conv [layers, n, conv_dim, K-1] and SSM [layers, n, HV, dk, dv], as StateSlots."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_snapshots: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_snapshots = num_snapshots
        self.conv = torch.zeros((num_layers, num_snapshots, *conv_shape), dtype=conv_dtype, device=device)
        self.ssm = torch.zeros((num_layers, num_snapshots, *ssm_shape), dtype=ssm_dtype, device=device)


@dataclass(slots=True, eq=False)
class Snapshot:
    index: int  # its place in the snapshot pool
    position: int  # tokens absorbed into the state
    prefix: bytes  # key of the position // page_size full pages before it
    tail: tuple[int, ...]  # the tokens after those pages, up to position
    tail_page: int | None  # KV page holding the tail's K/V (None when the tail is empty)
    tail_key: bytes | None  # the key that page is registered under while it holds this tail
    refs: int = 0  # restores planned from it and not yet launched
    indexed: bool = False
    mtp_gaps: bool = False  # its sequence had a position without MTP-head K/V of its own (kv_pages)


class SnapshotTable:
    def __init__(self, num_snapshots: int) -> None:
        self.capacity = num_snapshots
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._by_prefix: dict[bytes, list[Snapshot]] = {}
        self._unreferenced: OrderedDict[int, Snapshot] = OrderedDict()  # indexed, refs 0, oldest first

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self) -> int | None:
        """A place for a new snapshot: a free one, else the least recently used unreferenced snapshot's
        (which leaves the table); None when every snapshot is being read."""
        if self._free:
            return self._free.pop()
        if not self._unreferenced:
            return None
        _, snap = self._unreferenced.popitem(last=False)
        self._unindex(snap)
        return snap.index

    def release(self, index: int) -> None:
        """Gives back a place that was allocated but never indexed (its step was not launched)."""
        self._free.append(index)

    def add(self, snap: Snapshot) -> None:
        snap.indexed = True
        self._by_prefix.setdefault(snap.prefix, []).append(snap)
        self._unreferenced[snap.index] = snap

    def candidates(self, prefix: bytes) -> list[Snapshot]:
        return self._by_prefix.get(prefix, [])

    def find(self, prefix: bytes, tail: tuple[int, ...]) -> Snapshot | None:
        return next((s for s in self.candidates(prefix) if s.tail == tail), None)

    def ref(self, snap: Snapshot) -> None:
        if snap.refs == 0 and snap.indexed:
            self._unreferenced.pop(snap.index)
        snap.refs += 1

    def unref(self, snap: Snapshot) -> None:
        snap.refs -= 1
        if snap.refs == 0:
            if snap.indexed:
                self._unreferenced[snap.index] = snap  # most recently used
            else:
                self._free.append(snap.index)  # dropped while being read

    def drop(self, snap: Snapshot) -> None:
        """Removes a snapshot that can no longer be used (its tail page was evicted)."""
        self._unindex(snap)
        if snap.refs == 0:
            self._unreferenced.pop(snap.index, None)
            self._free.append(snap.index)

    def clear(self) -> None:
        """Every snapshot leaves the table; one being read is freed when its restore has launched."""
        for snaps in list(self._by_prefix.values()):
            for snap in list(snaps):
                self.drop(snap)

    def _unindex(self, snap: Snapshot) -> None:
        if not snap.indexed:
            return
        snap.indexed = False
        siblings = self._by_prefix[snap.prefix]
        siblings.remove(snap)
        if not siblings:
            del self._by_prefix[snap.prefix]
