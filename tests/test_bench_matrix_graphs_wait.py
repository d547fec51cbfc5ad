"""bench matrix starts its cells once the server's idle-time graph captures are done (read from its
log), and does not wait for a server that captures none."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from deltaserve.bench.matrix_server import (
    AHEAD_OF_NEED_DONE,
    DECODE_AHEAD_DONE,
    PREFILL_GRAPHS_ON,
    ServerProcess,
    wait_graphs_ahead,
)

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial


def _server(tmp_path, text: str) -> ServerProcess:
    log = tmp_path / "server.log"
    log.write_text(text)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    return ServerProcess(proc, "http://127.0.0.1:1", log, time.perf_counter())


def _log_later(server: ServerProcess, line: str, after_s: float = 0.5) -> None:
    """Appends `line` to the server's log `after_s` from now, on a thread of its own."""

    def append() -> None:
        time.sleep(after_s)
        with open(server.log_path, "a") as f:
            f.write(line)

    threading.Thread(target=append).start()


def test_waits_for_the_captures_ahead_of_need(tmp_path):
    server = _server(tmp_path, f"engine INFO {PREFILL_GRAPHS_ON} 2048 tokens\n")
    try:
        _log_later(server, f"engine INFO {AHEAD_OF_NEED_DONE}, 54 graphs in all, 8.1 s of idle time\n")
        waited = wait_graphs_ahead(server, timeout_s=10)
        assert waited is not None and 0.5 <= waited < 5
    finally:
        server.proc.kill()


def test_no_wait_without_prefill_graphs_nor_past_the_timeout(tmp_path):
    server = _server(tmp_path, "engine INFO engine ready\n")
    try:
        started = time.perf_counter()
        assert wait_graphs_ahead(server, timeout_s=10) is None
        assert time.perf_counter() - started < 1
        server.log_path.write_text(f"engine INFO {PREFILL_GRAPHS_ON} 2048 tokens\n")
        assert wait_graphs_ahead(server, timeout_s=0.5) is None
    finally:
        server.proc.kill()


def test_without_prefill_graphs_the_decode_buckets_left_to_idle_time_are_waited_for(tmp_path):
    left = "captured 11 decode graphs (batch buckets up to 64) in 0.6 s; the 24 larger buckets up to 512 are"
    server = _server(tmp_path, f"engine INFO {left} captured while idle or on first use\n")
    try:
        _log_later(
            server, f"engine INFO {DECODE_AHEAD_DONE}, 35 of 35 buckets captured, 1.6 s of idle time\n"
        )
        waited = wait_graphs_ahead(server, timeout_s=10)
        assert waited is not None and 0.5 <= waited < 5
        server.log_path.write_text("engine INFO captured 5 decode graphs (batch buckets up to 16) in 0.3 s\n")
        started = time.perf_counter()
        assert wait_graphs_ahead(server, timeout_s=10) is None  # none left: nothing to wait for
        assert time.perf_counter() - started < 1
    finally:
        server.proc.kill()
