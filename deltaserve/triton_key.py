"""Triton's installation hash, kept in the cache directory so that a warm start does not recompute it.

Triton keys every compiled kernel (and every remembered autotuning result) with `triton_key()`: a hash
of its own installation, computed once per process on the first kernel lookup by reading and hashing
its compiler sources and the whole libtriton shared library. On an H200 host that took 5.1 s of a
4B warm start's 20.5 s (cProfile; docs/benchmarks/2026-12-02-h200-mtp-c1-target.md), every start.

`reuse_triton_key()` keeps that hash in cache_root() under a fingerprint of the files it reads: their
paths, sizes and modification times, the test Python itself trusts for its .pyc files. An unchanged
installation reads the hash back; a reinstall or an edited file changes the fingerprint, and the hash
is computed again by Triton's own function. Triton replaces `triton_key` the same way in its own
worker processes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from deltaserve.cachedir import cache_root

logger = logging.getLogger(__name__)

# Under the triton package: what triton_key() reads (its compiler, backends, language and the
# libtriton library under _C), plus runtime/ where triton_key itself lives.
HASHED_DIRS = ("compiler", "backends", "language", "runtime", "_C")
HASHED_SUFFIXES = (".py", ".so")


def installation_fingerprint(package_dir: Path) -> str:
    """sha256 over (relative path, size, mtime in ns) of every .py and .so file under HASHED_DIRS."""
    digest = hashlib.sha256()
    for sub in HASHED_DIRS:
        for dirpath, dirnames, filenames in os.walk(package_dir / sub):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(HASHED_SUFFIXES):
                    continue
                path = Path(dirpath) / name
                stat = path.stat()
                digest.update(
                    f"{path.relative_to(package_dir)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
                )
    return digest.hexdigest()


def remembered_key(store: Path, compute: Callable[[], str]) -> str:
    """The key stored at `store`, or `compute()` written there first (atomically: a reader never sees
    a partial file; concurrent writers race harmlessly, both writing the same key)."""
    try:
        return store.read_text()
    except FileNotFoundError:
        pass
    key = compute()
    store.parent.mkdir(parents=True, exist_ok=True)
    staging = store.with_name(f".{store.name}.{os.getpid()}")
    staging.write_text(key)
    os.replace(staging, store)
    return key


def reuse_triton_key() -> None:
    """Makes this process's Triton read its installation hash from the cache directory (see the module
    docstring); without Triton (a CPU-only install), does nothing. Call before the first kernel
    compiles; processes started later (tensor-parallel ranks) call it again."""
    try:
        import triton
        import triton.runtime.autotuner as autotuner
        import triton.runtime.cache as triton_cache
    except ImportError:
        return
    original = triton_cache.triton_key
    if getattr(original, "deltaserve_remembered", False):
        return
    package_dir = Path(triton.__file__).parent
    store = cache_root() / "triton-key" / f"{triton.__version__}-{installation_fingerprint(package_dir)}"
    key: list[str] = []

    def triton_key() -> str:
        if not key:
            key.append(remembered_key(store, original))
        return key[0]

    triton_key.deltaserve_remembered = True  # type: ignore[attr-defined]
    triton_cache.triton_key = triton_key
    if getattr(autotuner, "triton_key", None) is original:
        autotuner.triton_key = triton_key
    logger.debug("Triton installation hash kept under %s", store.parent)
