"""The garbage collector and a serving process's start-up heap.

A full collection traverses every container object alive. In the API process that is ~210k objects
after start-up (FastAPI, pydantic, the tokenizer, torch's modules): ~120 ms on a CPU core, during
which no stream advances. Those objects live until exit, so once start-up is done they are moved to
the permanent generation, which collections never traverse. A full collection then costs ~2 ms.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects what start-up left behind, then freezes every object still alive; returns how many
    objects are frozen. Call once, when start-up is done and before serving."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
