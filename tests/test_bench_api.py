"""`deltaserve bench api`: the API server over a synthetic engine, loaded by bench serve, with the API
process's CPU per streamed token."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from deltaserve.bench.api import ApiProcessCost, format_api_cost
from deltaserve.bench.matrix_server import free_port, start_server, stop_server, wait_ready

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial


def test_cost_per_token_and_core_share_by_hand() -> None:
    cost = ApiProcessCost(cpu_s=1.5, wall_s=3.0, output_tokens=50_000)
    assert cost.us_per_token == 30.0
    assert cost.core_share == 0.5
    report = format_api_cost(cost, step_ms=5.0, max_num_seqs=256)
    assert "API process CPU per output token (us):  30.0" in report
    assert "API process share of one core (%):      50.0" in report


def _number(report: str, label: str) -> float:
    match = re.search(rf"^{re.escape(label)}\s+([0-9.]+)", report, re.MULTILINE)
    assert match is not None, f"{label!r} not in:\n{report}"
    return float(match.group(1))


def test_bench_api_streams_every_token_at_the_engines_pace_and_reports_the_api_process_cost(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltaserve.cli",
            "bench",
            "api",
            "--step-ms",
            "20",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "6",
            "--random-input-len",
            "8",
            "--random-output-len",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not list(tmp_path.glob("deltaserve-bench-api-*"))  # the server's log is not kept after a good run
    out = result.stdout
    assert _number(out, "Successful requests:") == 12
    assert _number(out, "Total generated tokens:") == 12 * 24
    # One token per request every 20 ms: the clients see about that pace (a loaded CI box adds some).
    assert 15.0 <= _number(out, "Median TPOT (ms):") <= 60.0
    assert _number(out, "API process CPU per output token (us):") > 0
    assert _number(out, "Engine step (ms):") == 20.0


def test_the_synthetic_engine_ends_a_dropped_stream_serves_on_and_drains_at_sigterm(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "deltaserve.cli", "bench", "api-server", "--step-ms", "20"]
    server = start_server([*argv, "--port", str(port)], url, tmp_path / "server.log")
    try:
        wait_ready(server, 120)
        body = {"prompt": [1, 2, 3], "max_tokens": 1000, "stream": True}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body) as stream:
                events = [line for line in itertools.islice(stream.iter_lines(), 8) if line]
            assert len(events) >= 3 and all(e.startswith("data: {") for e in events)
            deadline = time.monotonic() + 10  # the dropped stream is aborted in the engine
            while client.get(f"{url}/load").json()["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.get(f"{url}/load").json()["running"] == 0
            whole = client.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5}).json()
            assert whole["usage"]["completion_tokens"] == 5
            assert whole["choices"][0]["finish_reason"] == "length"
            with client.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 50}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line)  # running when the signal comes
                server.proc.send_signal(signal.SIGTERM)  # drains: the request runs to its end
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(30) == 0
    finally:
        stop_server(server)


def test_bench_api_refuses_a_step_or_a_row_count_that_is_not_positive() -> None:
    for flag, value, expected in (
        ("--step-ms", "0", "argument --step-ms: expected a positive number of milliseconds, got '0'"),
        ("--max-num-seqs", "-3", "argument --max-num-seqs: expected a positive whole number, got '-3'"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "deltaserve.cli", "bench", "api", flag, value],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and expected in result.stderr
