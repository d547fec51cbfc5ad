"""The state transaction of a hybrid model: KV pages, state slot and position of a sequence move together.

The CacheManager is the one owner of cache allocation: the scheduler allocates, reserves, advances and
releases through it; the backend only executes over the pages and slots a step names. A
`SequenceCache` is one sequence's claim on both pools. Invariant, checked at every boundary:
    num_computed == tokens whose K/V are in `pages` == tokens absorbed into the slot's conv/SSM state.
`reserve` only adds pages (it never changes what is computed); `advance` moves the position after a
forward has written both kinds of state; `release` returns pages and slot in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.kv_pages import PageAllocator
from deltaserve.cache.state_slots import SlotAllocator


@dataclass(slots=True)
class SequenceCache:
    slot: int
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # the cursor: KV length == state length == this
    released: bool = False


class CacheManager:
    def __init__(self, *, num_pages: int, page_size: int, num_slots: int) -> None:
        self.kv = PageAllocator(num_pages, page_size)
        self.states = SlotAllocator(num_slots)

    @classmethod
    def for_device(cls, caches: DeviceCaches) -> CacheManager:
        """Allocation over every page and slot of `caches`."""
        return cls(
            num_pages=caches.kv.num_pages, page_size=caches.page_size, num_slots=caches.states.num_slots
        )

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def can_open(self, num_tokens: int) -> bool:
        return self.states.num_free > 0 and self.kv.pages_for(num_tokens) <= self.kv.num_free

    def open(self, num_tokens: int = 0) -> SequenceCache:
        """Claims a state slot and pages for `num_tokens` positions (both or neither)."""
        pages = self.kv.allocate(self.kv.pages_for(num_tokens))
        try:
            slot = self.states.allocate()
        except MemoryError:
            self.kv.free(pages)
            raise
        return SequenceCache(slot=slot, pages=pages)

    def pages_needed(self, seq: SequenceCache, total_tokens: int) -> int:
        return max(0, self.kv.pages_for(total_tokens) - len(seq.pages))

    def reserve(self, seq: SequenceCache, total_tokens: int) -> None:
        """Makes `seq` hold pages for `total_tokens` positions."""
        self._check_live(seq)
        need = self.pages_needed(seq, total_tokens)
        if need:
            seq.pages.extend(self.kv.allocate(need))

    def advance(self, seq: SequenceCache, num_tokens: int) -> None:
        """Records that a forward wrote `num_tokens` more positions into both KV and state."""
        self._check_live(seq)
        new_total = seq.num_computed + num_tokens
        if new_total > len(seq.pages) * self.page_size:
            raise AssertionError(f"sequence advanced to {new_total} tokens past its {len(seq.pages)} pages")
        seq.num_computed = new_total

    def release(self, seq: SequenceCache) -> None:
        """Returns the sequence's pages and slot. Idempotent: a second release is a no-op."""
        if seq.released:
            return
        self.kv.free(seq.pages)
        self.states.free(seq.slot)
        seq.pages = []
        seq.released = True

    @staticmethod
    def _check_live(seq: SequenceCache) -> None:
        if seq.released:
            raise AssertionError("use of a released sequence cache")
