"""The start-up heap is frozen: a full collection then traverses only what serving created since."""

from __future__ import annotations

import gc
import time

import pytest

from deltaserve.heap import collections_paused, freeze_startup_heap

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial


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


def test_collections_paused_freezes_and_disables_then_restores():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with collections_paused():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
    kept = [{"i": [i]} for i in range(10)]
    freeze_startup_heap()
    try:
        with collections_paused():
            pass
        assert gc.get_freeze_count() >= len(kept)  # a start-up heap frozen before stays frozen
    finally:
        gc.unfreeze()
