"""A tensor-parallel rank killed while a request streams, seen from an HTTP client (CPU and GPU tests)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from server_fixture import ServerProcess


def rank_pids(server: ServerProcess) -> dict[str, int]:
    """The engine's rank processes by name (dserve-rank1, ...)."""
    engine = server.engine_pid()
    children = Path(f"/proc/{engine}/task/{engine}/children").read_text().split()
    names = {int(pid): Path(f"/proc/{pid}/comm").read_text().strip() for pid in children}
    return {name: pid for pid, name in names.items() if name.startswith("dserve-rank")}


@dataclass(frozen=True, slots=True)
class KilledMidStream:
    tokens_before: int  # streamed before the kill
    error: dict | None  # the stream's error event
    done: bool  # the stream ended with [DONE]
    seconds: float  # from the kill to the end of the stream


def kill_a_rank_mid_stream(
    server: ServerProcess, rank: str = "dserve-rank1", timeout_s: float = 300
) -> KilledMidStream:
    body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    pid = rank_pids(server)[rank]
    events = []
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=timeout_s) as response:
        assert response.status_code == 200, response.read()
        lines = (line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: "))
        for line in lines:
            events.append(line)
            if len(events) == 3:
                break
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        events.extend(lines)
        seconds = time.monotonic() - killed_at
    payloads = [json.loads(e) for e in events if e != "[DONE]"]
    errors = [p["error"] for p in payloads if "error" in p]
    tokens = sum(1 for p in payloads[:3] if "choices" in p)
    return KilledMidStream(tokens, errors[-1] if errors else None, events[-1] == "[DONE]", seconds)
