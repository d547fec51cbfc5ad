"""`deltaserve serve` as a child process of the matrix runner: start, time to HTTP ready, stop.

"HTTP ready" is the first 200 from GET /health; the server answers nothing on its port before its
engine is ready. The server runs in its own session (process group), so a stop that has to force it
reaches the engine process it spawned too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT_S = 60.0
# A line the server logged at ERROR or above (its format: "<date> <time> <logger> <LEVEL> <message>").
_LOG_ERROR = re.compile(r" (ERROR|CRITICAL) ")


class ServerError(RuntimeError):
    """The server exited or did not answer; the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ServerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    started_at: float  # time.perf_counter() just before the process was spawned

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_size(self) -> int:
        """Bytes written to the log so far: an offset for `errors_since`."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def errors_since(self, offset: int, limit: int = 3) -> list[str]:
        """The first `limit` lines logged at ERROR or CRITICAL after byte `offset` of the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if _LOG_ERROR.search(line)][:limit]


def start_server(argv: list[str], url: str, log_path: Path) -> ServerProcess:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        started_at = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return ServerProcess(proc, url, log_path, started_at)


def wait_ready(server: ServerProcess, timeout_s: float) -> float:
    """Seconds from process start to the first 200 of /health; raises ServerError if the process exits
    or the deadline passes (the server is left running: the caller stops it)."""
    deadline = server.started_at + timeout_s
    while True:
        if server.proc.poll() is not None:
            raise ServerError(
                f"the server exited with {server.proc.returncode} during start-up; its log ends:\n"
                f"{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.perf_counter() - server.started_at
        except (urllib.error.URLError, OSError):
            pass
        if time.perf_counter() > deadline:
            raise ServerError(
                f"GET {server.url}/health gave no 200 within {timeout_s:g} s of the start (raise "
                f"--ready-timeout-s); the server log ends:\n{server.log_tail()}"
            )
        time.sleep(0.1)


# Lines of the engine's log (engine/core.py, engine/idle_captures.py). Idle time captures the decode
# buckets left from start-up first, then the prefill graphs: the last list that runs ends the wait.
PREFILL_GRAPHS_ON = "prefill graphs: steps of up to"
AHEAD_OF_NEED_DONE = "prefill graphs ahead of need: done"
DECODE_GRAPHS_LEFT = "larger buckets up to"  # in the decode graphs' start-up line when some are left
DECODE_AHEAD_DONE = "decode graphs ahead of need: done"


def wait_graphs_ahead(server: ServerProcess, timeout_s: float) -> float | None:
    """Seconds from process start until the server has logged that its idle-time graph captures are
    done, so that a measured cell meets replays where a server that has been up a while would; None
    when it captures none (no prefill graphs, no decode buckets left) or the timeout passes first."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and server.proc.poll() is None:
        text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
        if PREFILL_GRAPHS_ON in text:
            done = AHEAD_OF_NEED_DONE
        elif DECODE_GRAPHS_LEFT in text:
            done = DECODE_AHEAD_DONE
        else:
            return None
        if done in text:
            return time.perf_counter() - server.started_at
        time.sleep(0.2)
    return None


def first_completion_s(server: ServerProcess, model: str | None, timeout_s: float = 300.0) -> float:
    """Seconds from process start until a 1-token completion of a 1-token prompt has returned.
    `model` None: the served model (a request that names none gets it)."""
    body = {"model": model, "prompt": [0], "max_tokens": 1, "ignore_eos": True, "temperature": 0.0}
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            payload = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServerError(
            f"the first completion failed: {exc}; the server log ends:\n{server.log_tail()}"
        ) from exc
    if payload.get("usage", {}).get("completion_tokens") != 1:
        raise ServerError(f"the first completion returned {json.dumps(payload)[:500]}, not 1 token")
    return time.perf_counter() - server.started_at


def read_counter(server: ServerProcess, name: str, timeout_s: float = 5.0) -> float | None:
    """A counter of the server's GET /metrics (`name` as registered, e.g. "vllm:num_preemptions"), summed
    over its labels; None when the metrics cannot be read or have no such counter."""
    try:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError, UnicodeDecodeError):
        return None
    # Imported here: the CLI builds every parser, this module's included, before `serve` sets up
    # prometheus_client's multiprocess mode, which must come before its first import.
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == name and family.type == "counter":
            return sum(s.value for s in family.samples if s.name == f"{name}_total")
    return None


def stop_server(server: ServerProcess, timeout_s: float = STOP_TIMEOUT_S) -> float:
    """SIGTERM, then up to `timeout_s` for the exit; past that the server's process group is killed.
    Returns the seconds the stop took. Safe to call twice."""
    start = time.perf_counter()
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(server.proc)
    _kill_group(server.proc)  # an engine child left behind by a server that exited
    return time.perf_counter() - start


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # The group id is the server's pid (start_new_session); it stays valid while any member lives.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(10)
