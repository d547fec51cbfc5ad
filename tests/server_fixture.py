"""The real `deltaserve serve` as a subprocess on a free port, for the server tests.

Each test module starts one (module-scoped fixture) on the embedded tiny random checkpoint, on CPU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from deltaserve.engine.process import ENGINE_PROCESS_NAME

SMALL_ENGINE = ["--device", "cpu", "--max-num-seqs", "16", "--max-model-len", "2048"]
MODEL = "deltaserve-tiny-random"  # the default served name of the embedded checkpoint
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        log_fd, self.log_path = tempfile.mkstemp(prefix="deltaserve-server-", suffix=".log")
        cmd = [
            sys.executable,
            "-m",
            "deltaserve.cli",
            "serve",
            *SMALL_ENGINE,
            "--port",
            str(self.port),
            *args,
        ]
        env = {**os.environ, "DELTASERVE_LOG_LEVEL": "INFO"}
        env.pop("DELTASERVE_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
        os.close(log_fd)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def wait_ready(self) -> None:
        """Polls /health. The port must answer nothing until the engine is ready, then 200."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up:\n{self.log()}"
                )
            try:
                status = httpx.get(f"{self.url}/health", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if status != 200:
                raise AssertionError(f"the first answer of /health was {status}, not 200:\n{self.log()}")
            return
        self.kill()
        raise TimeoutError(f"server not ready within {START_TIMEOUT_S} s:\n{self.log()}")

    def engine_pid(self) -> int:
        """The EngineCore child process (it names itself; the grammar compiler is a child too)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            if Path(f"/proc/{pid}/comm").read_text().strip() == ENGINE_PROCESS_NAME:
                return int(pid)
        raise RuntimeError(f"no engine child among {children}")

    def rss_bytes(self) -> int:
        """Resident memory of the server process itself (not its children)."""
        pages = int(Path(f"/proc/{self.proc.pid}/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def get_json(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0.0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(w in line for w in want):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@contextmanager
def running_server(*args: str) -> Iterator[ServerProcess]:
    server = ServerProcess(*args)
    try:
        server.wait_ready()
        yield server
    finally:
        try:
            server.terminate(30)
        finally:
            server.kill()
            os.unlink(server.log_path)


def wait_until_idle(server: ServerProcess, timeout_s: float = 5.0) -> dict[str, Any]:
    """Polls /load until nothing runs or waits and no KV page is in use; returns that snapshot."""
    deadline = time.monotonic() + timeout_s
    load: dict[str, Any] = {}
    while time.monotonic() < deadline:
        load = server.get_json("/load")
        if load["running"] == 0 and load["waiting"] == 0 and load["kv_pages_used"] == 0:
            return load
        time.sleep(0.02)
    raise AssertionError(f"engine not idle within {timeout_s} s: {json.dumps(load)}")


def token_counts(usage: Any) -> dict[str, Any]:
    """A response's usage without its cached share: the second of two identical requests is partly
    served from the prefix cache, so only its cached_tokens differ from the first's."""
    counts = usage.model_dump()
    counts.pop("prompt_tokens_details", None)
    counts.get("input_tokens_details", {}).pop("cached_tokens", None)
    return counts
