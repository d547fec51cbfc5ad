"""The name ps and top show for a deltaserve process (engine, tensor-parallel ranks, helpers)."""

from __future__ import annotations

API_WORKER_NAME = "dserve-api"  # + the index: the extra API server processes (--api-server-count)


def set_process_name(name: str) -> None:
    """Names this process for ps/top on Linux; a no-op elsewhere."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass
