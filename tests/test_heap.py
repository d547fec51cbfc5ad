"""The start-up heap is frozen: a full collection then traverses only what serving created since."""

from __future__ import annotations

import gc
import time

from deltaserve.heap import freeze_startup_heap


def test_a_full_collection_skips_the_frozen_start_up_heap():
    startup = [{"i": [i]} for i in range(300_000)]  # a start-up heap: containers alive until exit
    try:
        t = time.perf_counter()
        gc.collect()
        unfrozen = time.perf_counter() - t
        assert freeze_startup_heap() >= len(startup)
        t = time.perf_counter()
        gc.collect()
        frozen = time.perf_counter() - t
        assert frozen < unfrozen / 3, (frozen, unfrozen)
    finally:
        gc.unfreeze()
