"""The latency log's first-token lines: written by the API server, cut by `bench steps` at the steps."""

from __future__ import annotations

import argparse
import logging

import pytest

from deltaserve import itl_debug
from deltaserve.bench.first_token_log import (
    FirstToken,
    FirstTokenSplit,
    StepEnds,
    first_token_stats,
    parse_first_tokens,
    split_first_token,
)
from deltaserve.bench.step_log import run_bench_steps
from deltaserve.engine.protocol import LoadSnapshot
from deltaserve.server.metrics import ServerMetrics


def req_line(token_us: int, arrival_us: int, submitted_us: int, queued_us: int, prompt: int) -> str:
    return (
        f"2026-12-06 04:06:01,493 deltaserve.itl INFO ITL_REQ mono_us={token_us} arrival_us={arrival_us} "
        f"submitted_us={submitted_us} queued_us={queued_us} prompt_tokens={prompt}"
    )


def step_line(end_us: int, step_us: int, prefill: int = 0, rows: int = 0) -> str:
    return (
        f"2026-12-06 04:06:01,400 engine INFO ITL_STEP mono_us={end_us} kind=prefill prefill_tokens={prefill} "
        f"prefill_reqs={1 if prefill else 0} decode_rows={rows} step_us={step_us} phases_us=-"
    )


def test_the_api_server_logs_one_line_at_a_requests_first_token_only_with_the_flag(monkeypatch, caplog):
    metrics = ServerMetrics("m", LoadSnapshot)
    times = iter([5.0, 5.25])  # the tracker's submission, then the first token
    monkeypatch.setattr("deltaserve.server.metrics.time.monotonic", lambda: next(times))
    monkeypatch.setattr(itl_debug, "ITL_DEBUG", True)
    with caplog.at_level(logging.INFO, logger="deltaserve.itl"):
        tracker = metrics.track(4.5)
        tracker.on_tokens(1, 8192, 0.0625)
        monkeypatch.setattr("deltaserve.server.metrics.time.monotonic", lambda: 6.0)
        tracker.on_tokens(1, 8192, None)  # the second token: no line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "ITL_REQ mono_us=5250000 arrival_us=4500000 submitted_us=5000000 queued_us=62500 prompt_tokens=8192"
    ]
    assert parse_first_tokens(lines) == [FirstToken(5_250_000, 4_500_000, 5_000_000, 62_500, 8192)]
    caplog.clear()
    monkeypatch.setattr(itl_debug, "ITL_DEBUG", False)
    with caplog.at_level(logging.INFO, logger="deltaserve.itl"):
        metrics.track(7.0).on_tokens(1, 16, 0.0)
    assert caplog.records == []


def test_a_first_token_is_cut_at_the_last_step_that_ended_before_it():
    # arrival 1,000; tokenized 1,004 (4 ms); first step with it at 1,004 + 2 = 1,006 ms; steps end at
    # 1,050 and 1,120 ms (the latter 60 ms on the device); the token reaches the API server at 1,121.5 ms.
    first = FirstToken(1_121_500, 1_000_000, 1_004_000, 2_000, 8192)
    steps = StepEnds.of([(1_200_000, None), (1_120_000, 60_000), (900_000, 1), (1_050_000, None)])
    assert steps.ends_us == [900_000, 1_050_000, 1_120_000, 1_200_000]
    assert split_first_token(first, steps) == FirstTokenSplit(8192, 121.5, 4.0, 2.0, 114.0, 1.5, 60.0)
    # No step between its first scheduling and the token (the log began later), or no queue time: no cut.
    assert split_first_token(first, StepEnds.of([(900_000, None)])) is None
    assert split_first_token(FirstToken(1_121_500, 1_000_000, 1_004_000, None, 8192), steps) is None


def test_first_token_parts_are_grouped_by_prompt_length():
    splits = [
        FirstTokenSplit(8192, 130.0, 3.0, 1.0, 120.0, 6.0, 110.0),
        FirstTokenSplit(8000, 140.0, 5.0, 1.0, 128.0, 6.0),
        FirstTokenSplit(1, 8.0, 0.5, 0.5, 5.0, 2.0),
    ]
    small, large = first_token_stats(splits)
    assert (small.name, small.count, small.total_median_ms, small.steps_median_ms) == (
        "prompt 1-256",
        1,
        8.0,
        5.0,
    )
    assert (large.name, large.count) == ("prompt 2049-8192", 2)
    assert (large.total_median_ms, large.tokenize_median_ms, large.steps_median_ms) == (135.0, 4.0, 124.0)
    assert large.total_p99_ms == pytest.approx(139.9)
    assert (large.last_step_device_median_ms, small.last_step_device_median_ms) == (110.0, None)


def test_bench_steps_reports_the_first_tokens_beside_the_steps(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_text(
        "\n".join(
            [
                step_line(1_050_000, 44_000, prefill=4096),
                step_line(1_120_000, 70_000, prefill=4096) + " device_us=66000 idle_us=0",
                req_line(1_121_500, 1_000_000, 1_004_000, 2_000, 8192),
            ]
        )
        + "\n"
    )
    run_bench_steps(argparse.Namespace(logs=[str(log)], slowest=0))
    out = capsys.readouterr().out
    assert "time to first token in the server" in out
    assert (
        "  prompt 2049-8192          1   121.50   121.50      4.00     2.00   114.00    66.00      1.50"
        in out
    )
