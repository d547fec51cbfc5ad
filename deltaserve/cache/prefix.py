"""Content keys of the prefix cache: a hash chain over token ids, one key per full KV page.

key(page i) = H(key(page i - 1) || tokens of page i), key(page -1) = the root, so a key names the page's
tokens AND everything before them: two sequences share page i's KV exactly when their keys agree. The
root is ROOT, or for a request with a cache salt (vLLM's `cache_salt`: one tenant's requests) a root of
that salt's own, so requests of different salts share no page and no snapshot. A
GDN state snapshot at position P is indexed under the key of the P // page_size full pages before it
and holds the tail tokens [P - P % page_size, P) itself. blake2b with 128-bit digests: a collision
(which would serve another prefix's KV) is not a practical event.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b"deltaserve-prefix-root"


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    return _chain_packed(parent, array("I", tokens).tobytes())


def _chain_packed(parent: bytes, packed_tokens: bytes) -> bytes:
    """`chain` of tokens already packed as array("I") bytes."""
    return hashlib.blake2b(parent + packed_tokens, digest_size=16).digest()


def salted_root(salt: str | None) -> bytes:
    """The key before page 0 of a request with cache salt `salt` (ROOT without one)."""
    if salt is None:
        return ROOT
    return hashlib.blake2b(ROOT + b"\0cache_salt\0" + salt.encode(), digest_size=16).digest()


class PageKeys(list[bytes]):
    """The keys of a sequence's full pages (self[i] is page i's) and `root`, the key before page 0."""

    __slots__ = ("root",)

    def __init__(self, root: bytes = ROOT) -> None:
        super().__init__()
        self.root = root


def extend_page_keys(keys: PageKeys, tokens: Sequence[int], page_size: int) -> None:
    """Appends the keys of the full pages of `tokens` not yet in `keys`: `chain` of the key before and
    the page's tokens, with the tokens packed once rather than per page (admission waits on a long
    prompt's keys)."""
    start, end = len(keys), len(tokens) // page_size
    if start >= end:
        return
    ids = array("I", tokens[start * page_size : end * page_size])
    packed, width = ids.tobytes(), ids.itemsize * page_size  # width: bytes per page
    parent = keys[start - 1] if start else keys.root
    for offset in range(0, len(packed), width):
        parent = _chain_packed(parent, packed[offset : offset + width])
        keys.append(parent)


def prefix_key(keys: PageKeys, num_pages: int) -> bytes:
    """The key of the first `num_pages` full pages (the root for none)."""
    return keys[num_pages - 1] if num_pages else keys.root
