"""Where a serving engine takes new device memory: DELTASERVE_MEMORY_HISTORY=FILE (CUDA only).

The caching allocator calls cudaMalloc only when no cached block fits, and a server that keeps doing so
while it serves fragments its cache until an allocation fails and the allocator frees it all at a
device synchronisation (a stall of every stream). The step log counts those calls per step
(DELTASERVE_ITL_DEBUG=1: `allocs=cuda_malloc:N`); this names the code that makes them. With the
variable set, the engine process records the allocator's history with Python stacks from its start
(slower: for attribution runs), marks the moment it starts serving, and at exit writes the snapshot to
FILE (PyTorch's format: `torch.cuda.memory._snapshot()`, readable by its memory visualiser) and logs
the device allocations made while serving, grouped by the innermost deltaserve frame.
`python3 -m deltaserve.memory_history FILE` prints the same summary from a written file.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV = "DELTASERVE_MEMORY_HISTORY"
MAX_ENTRIES = 500_000  # trace entries kept (a ring): enough for minutes of eager steps
PROJECT_FRAME = "deltaserve/"


@dataclass(frozen=True, slots=True)
class AllocationSite:
    where: str  # file:line(function) of the innermost deltaserve frame, or of the innermost frame
    count: int  # device allocations (cudaMalloc) made there while serving
    bytes: int


def history_file() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def start_recording() -> bool:
    """Starts the allocator's history when DELTASERVE_MEMORY_HISTORY is set and CUDA is present."""
    if history_file() is None:
        return False
    import torch

    if not torch.cuda.is_available():
        logger.warning("%s is set but CUDA is not available: no memory history", ENV)
        return False
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    logger.info("recording the device allocator's history (%s); start-up and steps run slower", ENV)
    return True


def mark_serving() -> None:
    """A 'snapshot' entry in the history: the summary counts only allocations after the last one."""
    import torch

    torch.cuda.memory._snapshot()


def write_and_summarise(top: int = 15) -> None:
    path = history_file()
    assert path is not None
    import torch

    snapshot = torch.cuda.memory._snapshot()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    logger.info(
        "device allocator history written to %s\n%s", path, format_sites(serving_allocations(snapshot), top)
    )


def _where(frames: Iterable[Mapping[str, Any]]) -> str:
    frames = list(frames)
    chosen = next(
        (f for f in frames if PROJECT_FRAME in str(f.get("filename", ""))), frames[0] if frames else None
    )
    if chosen is None:
        return "(no stack)"
    filename = str(chosen.get("filename", "?"))
    short = filename[filename.rfind(PROJECT_FRAME) :] if PROJECT_FRAME in filename else Path(filename).name
    return f"{short}:{chosen.get('line', '?')}({chosen.get('name', '?')})"


def serving_allocations(snapshot: Mapping[str, Any]) -> list[AllocationSite]:
    """The segment allocations (cudaMalloc) of every device trace after its last 'snapshot' entry (the
    start of serving; the whole trace if none), by site, most frequent first. A trace lists frames
    innermost first."""
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for trace in snapshot.get("device_traces", []):
        starts = [i for i, entry in enumerate(trace) if entry.get("action") == "snapshot"]
        for entry in trace[starts[-1] + 1 if starts else 0 :]:
            if entry.get("action") != "segment_alloc":
                continue
            where = _where(entry.get("frames", []))
            counts[where] += 1
            sizes[where] += int(entry.get("size", 0))
    return [AllocationSite(where, n, sizes[where]) for where, n in counts.most_common()]


def format_sites(sites: list[AllocationSite], top: int) -> str:
    if not sites:
        return "no device allocation while serving"
    total = sum(s.count for s in sites)
    lines = [f"{total} device allocations while serving; by site:", f"{'count':>7} {'MiB':>10}  site"]
    lines += [f"{s.count:7d} {s.bytes / 2**20:10.1f}  {s.where}" for s in sites[:top]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m deltaserve.memory_history SNAPSHOT_FILE", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        snapshot = pickle.load(f)  # noqa: S301 (a file this module wrote)
    print(format_sites(serving_allocations(snapshot), top=40))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
