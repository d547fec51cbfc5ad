"""A profile of a process's start-up, for attributing a slow start: DELTASERVE_PROFILE_STARTUP=DIR.

With the variable set, the engine process (and each tensor-parallel rank) runs its start-up under
cProfile, from its first import of the engine to the engine being built. It writes DIR/<role>-<pid>.prof
(`python3 -m pstats`, snakeviz, ...) and logs the functions with the most cumulative time. Only the
profiled thread is seen: the grammar compiler's thread is not. Unset, nothing is imported and nothing
runs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pstats
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "DELTASERVE_PROFILE_STARTUP"
LOGGED_ENTRIES = 40


def profile_dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def top_entries(stats: pstats.Stats, count: int) -> str:
    """The `count` functions with the most cumulative time, one per line: cumulative s, own s, calls,
    file:line(function)."""
    rows = sorted(stats.stats.items(), key=lambda item: item[1][3], reverse=True)[:count]  # type: ignore[attr-defined]
    out = io.StringIO()
    out.write(f"{'cumulative s':>12} {'own s':>8} {'calls':>8}  function\n")
    for (file, line, name), (_, calls, own, cumulative, _) in rows:
        out.write(f"{cumulative:12.3f} {own:8.3f} {calls:8d}  {Path(file).name}:{line}({name})\n")
    return out.getvalue()


@contextlib.contextmanager
def profiled_startup(role: str) -> Iterator[None]:
    """Profiles the block when DELTASERVE_PROFILE_STARTUP names a directory (created if missing)."""
    directory = profile_dir()
    if directory is None:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{role}-{os.getpid()}.prof"
        profile.dump_stats(path)
        stats = pstats.Stats(profile)
        logger.info(
            "start-up profile of %s written to %s (%.1f s profiled); by cumulative time:\n%s",
            role,
            path,
            stats.total_tt,  # type: ignore[attr-defined]
            top_entries(stats, LOGGED_ENTRIES),
        )
