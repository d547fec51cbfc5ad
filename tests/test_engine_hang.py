"""A hung engine is detected, a slow one never is, and a second signal forces the exit.

Each test runs its own server (each ends it). A frozen engine is made with SIGSTOP; a long step with a
JSON schema that takes seconds to compile, which the engine does on its scheduler thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixture import ServerProcess, running_server

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial

LONG = {"max_tokens": 1500, "ignore_eos": True}


def _sse(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def _health_statuses_until_exit(server: ServerProcess, within_s: float) -> set[int]:
    statuses = set()
    deadline = time.monotonic() + within_s
    while server.proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):  # the port closes as the server exits
            statuses.add(httpx.get(f"{server.url}/health", timeout=1).status_code)
        time.sleep(0.05)
    return statuses


def _slow_schema_body(stream: bool = False) -> dict[str, Any]:
    """About 6 s to compile on CPU (1,000 optional properties), in the server and again in the engine."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    return {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": stream,
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}},
    }


def test_a_stopped_engine_is_detected_fails_in_flight_with_503_and_the_server_exits_nonzero() -> None:
    with running_server("--engine-heartbeat-timeout-s", "2") as server:
        engine = server.engine_pid()
        try:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={"prompt": "frozen", "stream": True, **LONG},
                timeout=60,
            ) as response:
                events = _sse(response)
                next(events)
                stopped_at = time.monotonic()
                os.kill(engine, signal.SIGSTOP)
                rest = list(events)
                detected_s = time.monotonic() - stopped_at
            error = json.loads(rest[-2])["error"]
            assert rest[-1] == "[DONE]" and error["code"] == 503 and "heartbeat" in error["message"]
            assert 2.0 <= detected_s < 6.0, detected_s
            assert _health_statuses_until_exit(server, 10) <= {503}
            assert server.proc.wait(10) == 1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)


def test_a_long_working_step_is_never_declared_dead() -> None:
    with running_server(
        "--engine-heartbeat-timeout-s", "1", "--structured-output-compile-timeout-s", "60"
    ) as server:
        started = time.monotonic()
        out = httpx.post(f"{server.url}/v1/chat/completions", json=_slow_schema_body(), timeout=120)
        took = time.monotonic() - started
        assert out.status_code == 200, out.text
        assert took > 2.0, "the step was not longer than the heartbeat limit; the test shows nothing"
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert server.proc.poll() is None


def test_an_engine_loop_stuck_past_the_step_limit_is_hung() -> None:
    with running_server(
        "--engine-step-timeout-s", "1", "--structured-output-compile-timeout-s", "60"
    ) as server:
        out = httpx.post(f"{server.url}/v1/chat/completions", json=_slow_schema_body(), timeout=120)
        assert out.status_code == 503, out.text
        assert "completed no step" in out.json()["error"]["message"]
        assert server.proc.wait(15) == 1


def test_a_second_sigterm_forces_the_exit() -> None:
    with running_server("--shutdown-timeout-s", "60") as server:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={"prompt": "long", "stream": True, **LONG},
            timeout=60,
        ) as response:
            events = _sse(response)
            next(events)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert server.proc.poll() is None, "the first signal drains: the stream keeps running"
            signalled_at = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(httpx.TransportError):
                list(events)
        assert server.proc.wait(15) == 1
        assert time.monotonic() - signalled_at < 10
