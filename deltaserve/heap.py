"""The garbage collector and a serving process's start-up heap; and a collector paused for a
benchmark client's measured run.

A full collection traverses every container object alive. In the API process that is ~210k objects
after start-up (FastAPI, pydantic, the tokenizer, torch's modules): ~120 ms on a CPU core, during
which no stream advances. Those objects live until exit, so once start-up is done they are moved to
the permanent generation, which collections never traverse. A full collection then costs ~2 ms.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> int:
    """Collects what start-up left behind, then freezes every object still alive; returns how many
    objects are frozen. Call once, when start-up is done and before serving."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def collections_paused() -> Iterator[None]:
    """No collection runs inside: what is alive at entry is frozen and the collector is off. At exit the
    collector is back as it was, what was frozen here is unfrozen (all stays frozen if something
    already was at entry: the caller's start-up heap), and one collection frees the run's cycles. For
    a client timing token arrivals, whose own collection pauses would count as the server's gaps."""
    was_enabled = gc.isenabled()
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if frozen_before == 0:
            gc.unfreeze()
        if was_enabled:
            gc.enable()
        gc.collect()
