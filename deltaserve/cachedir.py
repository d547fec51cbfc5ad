"""Build-once directories under $DELTASERVE_CACHE_DIR (default ~/.cache/deltaserve)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DELTASERVE_CACHE_DIR") or Path.home() / ".cache" / "deltaserve")


def use_kernel_cache() -> Path:
    """Points Triton's cache (compiled kernels, and the autotuning results fla keeps there) at
    cache_root()/triton unless TRITON_CACHE_DIR is set, so that a restart which keeps the cache directory
    (a mounted volume, say) reuses them instead of compiling and autotuning again. Triton reads the
    variable at each compile, so this works until the first kernel compiles; processes started later
    (tensor-parallel ranks) inherit it. Returns the directory in use."""
    current = os.environ.get("TRITON_CACHE_DIR")
    if current:
        return Path(current)
    path = cache_root() / "triton"
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


def build_once(name: str, write: Callable[[Path], None]) -> Path:
    """Returns cache_root()/name, calling `write(tmp_dir)` first if it does not exist yet.

    Invariant: the named directory only ever appears by atomic rename of a fully written temporary
    directory, so a directory that exists is complete; concurrent builders race harmlessly when `write`
    is deterministic."""
    root = cache_root()
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        write(staging)
        try:
            staging.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
