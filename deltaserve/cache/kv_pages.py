"""Paged KV for the full-attention layers: the device pages and their allocator.

Pages are fixed-size blocks of `page_size` token positions holding K and V of every full-attention layer.
Page 0 is reserved: it is never handed out, so padding rows (CUDA-graph buckets) can point at it
without touching live data. Free pages are recycled LIFO (a recently freed page is likely still cached).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

DUMMY_PAGE = 0  # reserved: padding rows point here


class KVPages:
    """Device memory: K and V of every full-attention layer, [layers, num_pages, page_size, kv_heads, dim]."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the index-th full-attention layer: [num_pages, page_size, kv_heads, head_dim] each."""
        return self.k[index], self.v[index]


class PageAllocator:
    """Which pages are handed out, how many holders share each, and which hold reusable content.

    A page is free, referenced (held by sequences, snapshots being written or pending copies: ref > 0),
    or cached (ref 0 and registered under a content key: found again by its key, and evicted least
    recently used when a page is needed). Only an unreferenced page is ever evicted or handed out.
    `num_free` counts free and cached pages: both can be handed out."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered pages, oldest first
        # Registered pages whose MTP-head K/V has a position its own MTP pass did not write (speculative
        # decoding: a sequence that resumes from such a page must not draft).
        self._mtp_gaps: set[int] = set()

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the reserved page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages registered under a content key (referenced or not)."""
        return len(self._key_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def sole_held(self, pages: Sequence[int]) -> int:
        """How many of `pages` have one holder: those its holder's release hands back."""
        return list(map(self._refs.__getitem__, pages)).count(1)

    def allocate(self, n: int) -> list[int]:
        """`n` pages, each referenced once: free pages first, then the least recently used cached ones
        (which lose their key)."""
        if n > self.num_free:
            raise MemoryError(f"KV pool exhausted: asked for {n} pages, {self.num_free} free")
        take = min(n, len(self._free))
        pages = self._free[len(self._free) - take :][::-1]
        del self._free[len(self._free) - take :]
        while len(pages) < n:
            page, _ = self._cached.popitem(last=False)
            self._forget(page)
            pages.append(page)
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, page: int) -> None:
        """One more holder of `page` (a cached page becomes referenced again)."""
        if self._refs[page] == 0:
            self._cached.pop(page)
        self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page; an unreferenced page is cached if it has a key, else free."""
        for page in reversed(pages):
            self._refs[page] -= 1
            assert self._refs[page] >= 0, f"page {page} released more often than it was held"
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def register(self, page: int, key: bytes, *, mtp_gaps: bool = False) -> bool:
        """Makes `page` findable by `key` (`mtp_gaps`: see has_mtp_gaps). False (and nothing changes)
        when the key already names a page or the page already has a key: content is never registered
        twice."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        if mtp_gaps:
            self._mtp_gaps.add(page)
        if self._refs[page] == 0:
            self._cached[page] = None
        return True

    def lookup(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def has_mtp_gaps(self, page: int) -> bool:
        """The registered page's MTP-head K/V was not all written by the MTP pass of its sequence."""
        return page in self._mtp_gaps

    def forget_all(self) -> None:
        """Every key is dropped: cached pages become free, referenced ones are freed at their release."""
        for page in self._cached:
            self._free.append(page)
        self._cached.clear()
        self._key_of.clear()
        self._page_of.clear()
        self._mtp_gaps.clear()

    def _forget(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]
        self._mtp_gaps.discard(page)
