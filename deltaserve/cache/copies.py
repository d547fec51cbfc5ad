"""Device copies between a sequence's live cache and the prefix cache (and, for speculative decoding,
between state slots), run in order on every rank.

The cache manager decides them; the backend runs a step's copies before (restores, end-of-request
saves) or after (saves at a cache point inside the step) its forward, in the order given.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PageCopy:
    """K and V of every full-attention layer: page `src` -> page `dst` (a partial page is never shared
    for writing: its holder's continuation and the cache each get their own)."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class StateSave:
    """Conv and SSM state of every GDN layer: live slot -> snapshot."""

    slot: int
    snapshot: int


@dataclass(frozen=True, slots=True)
class StateRestore:
    """Conv and SSM state of every GDN layer: snapshot -> live slot."""

    snapshot: int
    slot: int


@dataclass(frozen=True, slots=True)
class StateCommit:
    """Conv and SSM state of every GDN layer: slot `src` -> slot `dst`. Speculative decoding: the state
    after a verify row's last accepted token (in a verify scratch slot) becomes the row's own state."""

    src: int
    dst: int


CacheCopy = PageCopy | StateSave | StateRestore | StateCommit
