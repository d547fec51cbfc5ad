"""Benchmark metrics against hand-computed values under `vllm bench serve`'s definitions."""

from __future__ import annotations

import json
import math

import pytest

from deltaserve.bench.metrics import (
    BenchResult,
    RequestRecord,
    compute_metrics,
    format_report,
    parse_goodput,
)
from deltaserve.bench.worst_gap import worst_gap, worst_gap_line


def _ok(send: float, chunks: list[float], prompt: int, completion: int) -> RequestRecord:
    return RequestRecord(True, "", send, chunks, prompt, completion)


# A: TTFT 100 ms, chunk gaps 30/40/30 ms, E2EL 200 ms, 4 tokens -> TPOT (200-100)/3 = 33.33 ms.
# B: TTFT 200 ms, one gap of 20 ms, E2EL 220 ms, 2 tokens -> TPOT 20 ms.
# C: one token: TTFT = E2EL = 300 ms, no gap, no TPOT.
# D: failed after one chunk; it must not count anywhere but `failed`.
A = _ok(0.0, [0.100, 0.130, 0.170, 0.200], prompt=10, completion=4)
B = _ok(0.050, [0.250, 0.270], prompt=20, completion=2)
C = _ok(0.0, [0.300], prompt=5, completion=1)
D = RequestRecord(False, "stream ended without [DONE] after 1 chunks with choices", 0.0, [0.9], 7, 0)


def _result(**kwargs: object) -> BenchResult:
    return compute_metrics([A, B, C, D], duration_s=0.5, **kwargs)  # type: ignore[arg-type]


def test_counts_and_throughputs_exclude_the_failed_request():
    r = _result()
    assert (r.completed, r.failed) == (3, 1)
    assert (r.total_input_tokens, r.total_output_tokens) == (35, 7)
    assert r.request_throughput == pytest.approx(3 / 0.5)
    assert r.output_throughput == pytest.approx(7 / 0.5)
    assert r.total_token_throughput == pytest.approx(42 / 0.5)
    assert r.request_goodput is None


def test_ttft_is_per_request_with_linear_interpolated_percentiles():
    ttft = _result().latency["ttft"]  # samples 100, 200, 300 ms
    assert ttft.mean_ms == pytest.approx(200.0)
    assert ttft.median_ms == pytest.approx(200.0)
    assert ttft.std_ms == pytest.approx(math.sqrt(20000 / 3))
    # p90 sits at rank 0.9·2 = 1.8 -> 200 + 0.8·100; p99 at 1.98 -> 200 + 0.98·100.
    assert ttft.percentiles_ms == pytest.approx({50.0: 200.0, 90.0: 280.0, 99.0: 298.0})


def test_itl_pools_chunk_gaps_of_all_requests():
    itl = _result().latency["itl"]  # gaps 30, 40, 30 (A) and 20 (B); C has none
    assert itl.mean_ms == pytest.approx(30.0)
    assert itl.median_ms == pytest.approx(30.0)
    # sorted 20, 30, 30, 40: p99 at rank 2.97 -> 30 + 0.97·10.
    assert itl.percentiles_ms[99.0] == pytest.approx(39.7)


def test_tpot_skips_single_token_requests():
    tpot = _result().latency["tpot"]  # A 33.33 ms, B 20 ms; C (1 token) excluded
    assert tpot.mean_ms == pytest.approx((100 / 3 + 20) / 2)
    assert tpot.median_ms == pytest.approx((100 / 3 + 20) / 2)
    assert tpot.percentiles_ms[99.0] == pytest.approx(20 + 0.99 * (100 / 3 - 20))


def test_e2el_ends_at_the_last_chunk():
    e2el = _result().latency["e2el"]  # 200, 220, 300 ms
    assert e2el.mean_ms == pytest.approx(240.0)
    assert e2el.median_ms == pytest.approx(220.0)
    assert e2el.percentiles_ms[99.0] == pytest.approx(220 + 0.98 * 80)


def test_peak_concurrency_counts_overlapping_successful_requests():
    # A [0, .2), B [.05, .27), C [0, .3) all overlap at 0.05; D is failed and ignored.
    assert _result().max_concurrent_requests == 3
    # Half-open intervals: a request ending when the next starts does not overlap it.
    back_to_back = [_ok(0.0, [0.5, 1.0], 1, 2), _ok(1.0, [1.5, 2.0], 1, 2)]
    assert compute_metrics(back_to_back, 2.0).max_concurrent_requests == 1


def test_peak_output_rate_counts_chunks_in_one_second_buckets_from_the_first_send():
    # Chunks at 0.5 | 1.2, 1.4 | 2.1 (+ 2.3 from the second request) -> buckets 1, 2, 2.
    records = [_ok(0.0, [0.5, 1.2, 1.4, 2.1], 1, 4), _ok(1.9, [2.3], 1, 1)]
    assert compute_metrics(records, 3.0).max_output_tokens_per_s == 2.0
    assert _result().max_output_tokens_per_s == 7.0  # every chunk of A, B, C lands in second 0


def test_goodput_needs_every_slo_and_counts_single_token_tpot_as_zero():
    # ttft<=250 and tpot<=30: A fails tpot (33.3), C fails ttft (300); only B is good.
    assert _result(goodput_ms={"ttft": 250.0, "tpot": 30.0}).request_goodput == pytest.approx(1 / 0.5)
    # tpot<=10 alone: only C (single token, TPOT counted as 0) is good.
    assert _result(goodput_ms={"tpot": 10.0}).request_goodput == pytest.approx(1 / 0.5)
    # e2el<=250: A (200) and B (220) are good.
    assert _result(goodput_ms={"e2el": 250.0}).request_goodput == pytest.approx(2 / 0.5)


def test_parse_goodput_accepts_name_ms_pairs_and_names_the_flag_on_error():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 10000.0,
    }
    for bad in ["itl:5", "ttft", "ttft:-1", "ttft:fast"]:
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_cached_share_sums_reported_cached_tokens_over_successful_prompt_tokens():
    # A reports 6 of its 10 prompt tokens cached, B omits the field (0 cached), C reports 0 of 5;
    # D (failed) reports 7 and must not count. Share = 6 / (10 + 20 + 5).
    a = _ok(0.0, [0.1], prompt=10, completion=1)
    a.cached_tokens = 6
    c = _ok(0.0, [0.1], prompt=5, completion=1)
    c.cached_tokens = 0
    d = RequestRecord(False, "HTTP 500", 0.0, [], 7, 0, cached_tokens=7)
    r = compute_metrics([a, B, c, d], 1.0)
    assert r.total_cached_tokens == 6
    assert r.cached_token_share == pytest.approx(6 / 35)
    assert r.to_json()["cached_token_share"] == pytest.approx(6 / 35)
    assert f"{'Cached prompt token share:':<40} {'17.14%':<10}" in format_report(r).splitlines()


def test_cached_share_is_not_reported_when_no_response_had_the_field():
    r = _result()
    assert r.total_cached_tokens is None and r.cached_token_share is None
    assert r.to_json()["cached_token_share"] is None
    assert f"{'Cached prompt token share:':<40} {'not reported':<10}" in format_report(r).splitlines()


def test_all_failed_reports_zero_latencies_like_vllm():
    r = compute_metrics([D], 1.0)
    assert (r.completed, r.failed, r.max_concurrent_requests, r.max_output_tokens_per_s) == (0, 1, 0, 0.0)
    assert r.latency["ttft"].mean_ms == 0.0 and r.latency["itl"].percentiles_ms[99.0] == 0.0


def test_to_json_uses_vllm_keys_for_the_selected_metrics_only():
    r = _result(percentile_metrics=("ttft", "itl"), percentiles=(50.0, 99.9))
    r.config = {
        "model": "m",
        "num_prompts": 4,
        "request_rate": math.inf,
        "max_concurrency": 2,
        "metadata": {},
    }
    r.environment = {"date": "20260101-000000"}
    out = json.loads(json.dumps(r.to_json()))  # must be strict JSON: inf becomes "inf"
    assert out["request_rate"] == "inf" and out["config"]["request_rate"] == "inf"
    assert out["completed"] == 3 and out["failed"] == 1 and out["duration"] == 0.5
    assert out["total_input_tokens"] == 35 and out["total_output_tokens"] == 7
    assert out["p99.9_ttft_ms"] == pytest.approx(200 + 0.998 * 100)
    assert out["p50_itl_ms"] == pytest.approx(30.0)
    assert {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "mean_itl_ms"} <= out.keys()
    assert not any("tpot" in k or "e2el" in k for k in out)
    assert "ttfts" not in out


def test_to_json_detailed_lists_every_request_in_send_order():
    out = _result().to_json(detailed=True)
    assert out["input_lens"] == [10, 20, 5, 7]
    assert out["output_lens"] == [4, 2, 1, 0]
    assert out["ttfts"] == pytest.approx([0.1, 0.2, 0.3, 0.9])
    assert out["itls"][0] == pytest.approx([0.03, 0.04, 0.03])
    assert out["errors"][3].startswith("stream ended without [DONE]")


def test_report_is_vllms_block():
    r = _result(goodput_ms={"ttft": 250.0})
    r.config = {"request_rate": 4.0, "max_concurrency": 8}
    lines = format_report(r).splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert f"{'Successful requests:':<40} {3:<10}" in lines
    assert f"{'Maximum request concurrency:':<40} {8:<10}" in lines
    assert f"{'Request rate configured (RPS):':<40} {4.0:<10.2f}" in lines
    assert f"{'Request goodput (req/s):':<40} {4.0:<10.2f}" in lines
    assert f"{'Mean TTFT (ms):':<40} {200.0:<10.2f}" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert f"{'P99 E2EL (ms):':<40} {298.4:<10.2f}" in lines
    assert lines[-1] == "=" * 50


def test_the_worst_gap_names_its_request_and_how_many_streams_it_stalled():
    def rec(send, times, success=True):
        return RequestRecord(success, "" if success else "boom", send, times, 4, len(times))

    records = [
        rec(0.0, [1.0 + 0.1 * k for k in range(8)]),  # a chunk every 100 ms: not stalled
        rec(0.0, [1.05, 1.15, 1.65, 1.75]),  # the worst gap: 1.15 -> 1.65
        rec(0.0, [1.10, 1.15, 1.65, 1.70]),  # the same gap at the same moment: stalled with it
        rec(1.5, [1.6, 1.7]),  # started during the gap: not active across it
        rec(0.0, [], success=False),
    ]
    gap = worst_gap(records)
    assert (gap.request, gap.token, gap.streams_stalled, gap.streams_active) == (1, 2, 1, 2)
    assert gap.ms == pytest.approx(500.0) and gap.at_s == pytest.approx(1.65)
    assert "500.0 ms, request 1 before chunk 2, 1.65 s into the run; 1 of 2" in worst_gap_line(gap)
    assert worst_gap([rec(0.0, [1.0])]) is None
