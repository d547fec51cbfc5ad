"""prometheus_client's multiprocess mode, for `--api-server-count` above 1: every API server process
records its request metrics in files of one directory, and /metrics in any of them sums them all.

The mode is chosen when prometheus_client is first imported, so `enable` runs before anything imports
it (light: `deltaserve serve` calls it before importing the server); the spawned API server processes
inherit the setting through their environment.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def enable(api_server_count: int) -> str | None:
    """A fresh directory for the processes' metric files (None for one process)."""
    if api_server_count <= 1:
        return None
    if "prometheus_client" in sys.modules and not os.environ.get(MULTIPROCESS_ENV):
        raise RuntimeError("prometheus_client was imported before its multiprocess mode was set up")
    directory = tempfile.mkdtemp(prefix="deltaserve-metrics-")
    os.environ[MULTIPROCESS_ENV] = directory
    return directory


def disable(directory: str | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        if os.environ.get(MULTIPROCESS_ENV) == directory:
            del os.environ[MULTIPROCESS_ENV]
