"""Request work that scales with the input runs on worker threads, never on the event loop.

Chat rendering, tokenization, JSON-schema preparation and /tokenize's answer run here; the event loop
only awaits them, so /health and every stream keep answering while a large input is prepared.
Tokenization releases the GIL (Tokenizer.encode); rendering is Python bytecode, which the interpreter
interleaves with the loop. Invariant: a body of at most SMALL_INPUT_BYTES never waits behind a larger
one: the two sizes have their own threads. After a large input the freed heap is handed back to the
operating system, so memory returns to its baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from fastapi import Request

P = ParamSpec("P")
T = TypeVar("T")

SMALL_INPUT_BYTES = 256 << 10
SMALL_THREADS = 4
LARGE_THREADS = 2


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim (returns free heap pages to the OS); None elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(name).malloc_trim
    return None


_malloc_trim = _load_malloc_trim()
_trim_lock = threading.Lock()


def release_free_memory() -> None:
    if _malloc_trim is not None and _trim_lock.acquire(blocking=False):
        try:
            _malloc_trim(0)
        finally:
            _trim_lock.release()


async def body_size(request: Request) -> int:
    """Bytes of the request body (read and kept by FastAPI before the handler runs)."""
    return len(await request.body())


class TextWorkers:
    def __init__(self, small_threads: int = SMALL_THREADS, large_threads: int = LARGE_THREADS) -> None:
        self._small = ThreadPoolExecutor(small_threads, thread_name_prefix="deltaserve-text")
        self._large = ThreadPoolExecutor(large_threads, thread_name_prefix="deltaserve-text-large")

    async def run(self, input_bytes: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on a worker thread; `input_bytes` (the request body's size) picks the pool."""
        large = input_bytes > SMALL_INPUT_BYTES
        call = (
            functools.partial(_then_trim, fn, *args, **kwargs)
            if large
            else functools.partial(fn, *args, **kwargs)
        )
        return await asyncio.get_running_loop().run_in_executor(self._large if large else self._small, call)

    def close(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)


def _then_trim(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    try:
        return fn(*args, **kwargs)
    finally:
        release_free_memory()
