"""Paged KV for the full-attention layers: the device pages and their allocator.

Pages are fixed-size blocks of `page_size` token positions holding K and V of every full-attention layer.
Page 0 is reserved: it is never handed out, so padding rows (CUDA-graph buckets) can point at it
without touching live data. Free pages are recycled LIFO (a recently freed page is likely still cached).
"""

from __future__ import annotations

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
    """Which pages are handed out. Knows nothing of their contents."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the reserved page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: asked for {n} pages, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
