"""Linux /proc readings of a process and its direct children (the API server, its engine, and its extra
API server processes): resident memory and CPU time. Each reading is None (or skips a process) where
/proc cannot tell."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from deltaserve.process_name import API_WORKER_NAME

_PAGE_BYTES = 4096


def child_pids(pid: int) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its children, in MiB."""
    total = 0
    for p in [pid, *child_pids(pid)]:
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1])
    return total * _PAGE_BYTES / 2**20


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of `pid` so far (all its threads), in seconds."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: fields count from the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def _is_api_worker(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().startswith(API_WORKER_NAME)
    return False


def tree_cpu_seconds(pid: int) -> dict[str, float] | None:
    """{"server": CPU s of `pid` and its extra API server processes, "engine": CPU s of its other
    children}, or None without /proc."""
    own = cpu_seconds(pid)
    if own is None:
        return None
    server, engine = own, 0.0
    for child in child_pids(pid):
        seconds = cpu_seconds(child)
        if seconds is None:
            continue
        if _is_api_worker(child):
            server += seconds
        else:
            engine += seconds
    return {"server": server, "engine": engine}
