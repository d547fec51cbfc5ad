"""`deltaserve bench api`: the API server over a synthetic engine, loaded by bench serve, with the API
process's CPU per streamed token."""

from __future__ import annotations

import re
import subprocess
import sys

from deltaserve.bench.api import ApiProcessCost, format_api_cost


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


def test_bench_api_streams_every_token_at_the_engines_pace_and_reports_the_api_process_cost() -> None:
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
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert _number(out, "Successful requests:") == 12
    assert _number(out, "Total generated tokens:") == 12 * 24
    # One token per request every 20 ms: the clients see about that pace (a loaded CI box adds some).
    assert 15.0 <= _number(out, "Median TPOT (ms):") <= 60.0
    assert _number(out, "API process CPU per output token (us):") > 0
    assert _number(out, "Engine step (ms):") == 20.0
