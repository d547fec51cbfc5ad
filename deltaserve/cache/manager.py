"""The state transaction of a hybrid model: KV pages, state slot and position of a sequence move together.

The CacheManager is the one owner of cache allocation: the scheduler allocates, shares, reserves,
advances and releases through it; the backend only executes over the pages and slots a step names, and
runs the device copies the manager decides. A `SequenceCache` is one sequence's claim on both pools.
Invariant, checked at every boundary:
    num_computed == tokens whose K/V are in `pages` == tokens absorbed into the slot's conv/SSM state.
`reserve` only adds pages (it never changes what is computed); `advance` moves the position after a
forward has written both kinds of state; `release` returns pages and slot in one call.

Prefix cache (when snapshots are configured): full pages are registered under their content keys
(cache/prefix.py) and shared by reference; GDN state snapshots (cache/snapshots.py) record the state at
chosen positions. A sequence resumes from a hit only where both exist for exactly that position
(`lookup`, `open_hit`): it shares the full pages, gets its own copy of the partial page at the boundary
and its slot takes the snapshot's state, so KV, state and position still move together. Device copies
of hits and of end-of-request snapshots wait in `pending` for the next launch; a snapshot is findable
only once the launch that writes it has happened (`launched`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deltaserve.cache.copies import CacheCopy, PageCopy, StateRestore, StateSave
from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.kv_pages import PageAllocator
from deltaserve.cache.prefix import PageKeys, chain, prefix_key
from deltaserve.cache.snapshots import Snapshot, SnapshotTable
from deltaserve.cache.state_slots import SlotAllocator


@dataclass(slots=True)
class SequenceCache:
    slot: int
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # the cursor: KV length == state length == this
    released: bool = False
    registered: int = 0  # leading full pages already offered to the prefix cache


@dataclass(slots=True)
class PrefixHit:
    position: int  # tokens whose KV and GDN state are cached: the sequence resumes here
    pages: list[int]  # the full pages before the snapshot's tail
    snapshot: Snapshot
    mtp_gaps: bool = False  # some cached position lacks MTP-head K/V of its own (PageAllocator)


@dataclass(slots=True)
class CacheWork:
    """Device copies one launch carries, and what they keep held until that launch has happened."""

    copies: list[CacheCopy] = field(default_factory=list)
    writes: list[Snapshot] = field(default_factory=list)  # indexed once launched
    held_pages: list[int] = field(default_factory=list)  # referenced until launched
    held_snapshots: list[Snapshot] = field(default_factory=list)  # read by a restore

    def extend(self, other: CacheWork) -> None:
        self.copies += other.copies
        self.writes += other.writes
        self.held_pages += other.held_pages
        self.held_snapshots += other.held_snapshots


class CacheManager:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        num_snapshots: int = 0,
        scratch_slots: int = 0,
    ) -> None:
        """`scratch_slots`: the last slots of the state pool, which speculative decoding's verify rows
        write per-token states into; never handed to a sequence."""
        self.kv = PageAllocator(num_pages, page_size)
        self.states = SlotAllocator(num_slots - scratch_slots)
        self.scratch_slots = range(num_slots - scratch_slots, num_slots)
        self.snapshots = SnapshotTable(num_snapshots) if num_snapshots > 0 else None
        self.pending = CacheWork()  # restores and end-of-request saves, for the next launch

    @classmethod
    def for_device(cls, caches: DeviceCaches, scratch_slots: int = 0) -> CacheManager:
        """Allocation over every page, slot and snapshot of `caches` (but the last `scratch_slots`)."""
        snapshots = caches.snapshots.num_snapshots if caches.snapshots is not None else 0
        return cls(
            num_pages=caches.kv.num_pages,
            page_size=caches.page_size,
            num_slots=caches.states.num_slots,
            num_snapshots=snapshots,
            scratch_slots=scratch_slots,
        )

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def prefix_caching(self) -> bool:
        return self.snapshots is not None

    # ---- the live state transaction -------------------------------------------------------------

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

    def pages_freed_by_release(self, seq: SequenceCache) -> int:
        """Pages that releasing `seq` gives back (shared pages stay with their other holders)."""
        return sum(1 for page in seq.pages if self.kv.refs(page) == 1)

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

    def rewind(self, seq: SequenceCache, num_tokens: int) -> None:
        """Takes back the last `num_tokens` positions of an advance: a verify row's rejected drafts,
        once its state has been committed to the last accepted token (their K/V stay in the pages,
        beyond the cursor, and are overwritten before any read)."""
        self._check_live(seq)
        if not 0 <= num_tokens <= seq.num_computed:
            raise AssertionError(f"cannot rewind {num_tokens} of {seq.num_computed} positions")
        seq.num_computed -= num_tokens

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

    # ---- the prefix cache -----------------------------------------------------------------------

    def lookup(self, keys: PageKeys, tokens: Sequence[int], limit: int) -> PrefixHit | None:
        """The longest prefix of `tokens`, at most `limit` tokens, whose KV pages and a GDN state snapshot
        at exactly its end are cached. `keys` are the page keys of `tokens` (at least limit // page_size)."""
        snaps = self.snapshots
        if snaps is None or limit <= 0:
            return None
        size = self.page_size
        pages: list[int] = []
        for key in keys[: limit // size]:
            page = self.kv.lookup(key)
            if page is None:
                break
            pages.append(page)
        stale: list[Snapshot] = []
        for full in range(len(pages), -1, -1):
            best = None
            for snap in snaps.candidates(prefix_key(keys, full)):
                if snap.position > limit or tuple(tokens[full * size : snap.position]) != snap.tail:
                    continue
                if snap.tail_page is not None and self.kv.lookup(snap.tail_key) != snap.tail_page:
                    stale.append(snap)  # its boundary page was evicted
                elif best is None or snap.position > best.position:
                    best = snap
            if best is not None:
                break
        for snap in stale:
            snaps.drop(snap)
        if best is None:
            return None
        held = pages[:full] + ([best.tail_page] if best.tail_page is not None else [])
        gaps = best.mtp_gaps or any(self.kv.has_mtp_gaps(page) for page in held)
        return PrefixHit(best.position, pages[:full], best, gaps)

    def open_hit(self, hit: PrefixHit) -> SequenceCache:
        """A sequence resuming at `hit.position`: it shares the full pages, gets its own copy of the
        boundary page (never shared for writing) and its new slot takes the snapshot's state; the copies
        run before the next launched forward."""
        snap = hit.snapshot
        slot = self.states.allocate()
        for page in hit.pages:
            self.kv.share(page)
        pages = list(hit.pages)
        work = CacheWork(held_snapshots=[snap])
        self.snapshots.ref(snap)
        if snap.tail_page is not None:
            self.kv.share(snap.tail_page)  # held: allocating its copy must not evict it
            work.held_pages.append(snap.tail_page)
            try:
                (own,) = self.kv.allocate(1)
            except MemoryError:
                self.kv.free(pages)
                self.states.free(slot)
                self._release_holds(work)
                raise
            pages.append(own)
            work.copies.append(PageCopy(snap.tail_page, own))
        work.copies.append(StateRestore(snap.index, slot))
        self.pending.extend(work)
        return SequenceCache(slot=slot, pages=pages, num_computed=hit.position, registered=len(hit.pages))

    def register_pages(self, seq: SequenceCache, keys: Sequence[bytes], *, mtp_gaps: bool = False) -> None:
        """Offers the sequence's computed full pages whose keys are known, once each (`mtp_gaps`: the
        sequence has a position without MTP-head K/V of its own). A page whose content another page
        already holds stays private (it is freed, not cached, at release)."""
        if self.snapshots is None:
            return
        full = min(len(keys), seq.num_computed // self.page_size, len(seq.pages))
        for i in range(seq.registered, full):
            self.kv.register(seq.pages[i], keys[i], mtp_gaps=mtp_gaps)
        seq.registered = max(seq.registered, full)

    def save(
        self,
        seq: SequenceCache,
        keys: PageKeys,
        tokens: Sequence[int],
        position: int,
        *,
        donate: bool,
        mtp_gaps: bool = False,
    ) -> CacheWork | None:
        """A snapshot of `seq` after `position` tokens, to be written by the launch that carries the
        returned work: the state must be exactly at `position` when its copies run and the KV of
        `tokens[:position]` in its pages. The boundary page is copied, or with `donate` (the sequence
        ends here) itself becomes the snapshot's. `mtp_gaps`: the sequence has a position without
        MTP-head K/V of its own. None when prefix caching is off, the same snapshot exists, or every
        snapshot place is being read."""
        snaps = self.snapshots
        size = self.page_size
        full = position // size
        if snaps is None or position <= 0 or len(keys) < full:
            return None
        prefix, tail = prefix_key(keys, full), tuple(tokens[full * size : position])
        if snaps.find(prefix, tail) is not None:
            return None
        index = snaps.allocate()
        if index is None:
            return None
        work = CacheWork(copies=[StateSave(seq.slot, index)])
        tail_page = None
        if tail:
            if donate:
                tail_page = seq.pages[full]
                self.kv.share(tail_page)
            else:
                try:
                    (tail_page,) = self.kv.allocate(1)
                except MemoryError:
                    snaps.release(index)
                    return None
                work.copies.append(PageCopy(seq.pages[full], tail_page))
            work.held_pages.append(tail_page)
        tail_key = chain(b"tail:" + prefix, tail) if tail else None
        work.writes.append(Snapshot(index, position, prefix, tail, tail_page, tail_key, mtp_gaps=mtp_gaps))
        return work

    def take_pending(self) -> CacheWork:
        work, self.pending = self.pending, CacheWork()
        return work

    def launched(self, work: CacheWork) -> None:
        """The launch carrying `work` has happened: its snapshots become findable, its holds end."""
        for snap in work.writes:
            if snap.tail_page is not None and not self.kv.register(
                snap.tail_page, snap.tail_key, mtp_gaps=snap.mtp_gaps
            ):
                existing = self.kv.lookup(snap.tail_key)
                if existing is None:  # the page has another key: it cannot serve this tail
                    self.snapshots.release(snap.index)
                    continue
                snap.tail_page = existing  # the same tail content, already cached
            self.snapshots.add(snap)
        self._release_holds(work)

    def abandoned(self, work: CacheWork) -> None:
        """The launch carrying `work` failed: nothing it would have written becomes findable."""
        for snap in work.writes:
            self.snapshots.release(snap.index)
        self._release_holds(work)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page and snapshot. Safe while requests run: pages and snapshots in use
        stay with their holders and are freed, not cached, when released."""
        self.kv.forget_all()
        if self.snapshots is not None:
            self.snapshots.clear()

    def _release_holds(self, work: CacheWork) -> None:
        self.kv.free(work.held_pages)
        for snap in work.held_snapshots:
            self.snapshots.unref(snap)
        work.held_pages, work.held_snapshots = [], []
