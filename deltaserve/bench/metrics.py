"""Serving-benchmark metrics, defined exactly as `vllm bench serve` defines them so numbers compare.

- TTFT: send -> first streamed chunk carrying `choices` (even with empty text). A chat chunk whose delta
  holds only the role carries no token and is not timed (vLLM sends it with the first token; a server
  that sends it before the prefill would otherwise report a TTFT without the prefill).
- ITL: gaps between successive `choices` chunks, pooled over all successful requests (a chunk carrying
  k tokens contributes one gap).
- TPOT per request: (E2EL - TTFT) / (completion_tokens - 1), only for requests with more than one token.
- E2EL: send -> last `choices` chunk (the usage chunk and `[DONE]` do not extend it).
- Percentiles: numpy's default linear interpolation. An empty sample reports 0, as vLLM does.
- Token counts come from the server's final `usage` chunk. The cached-token share is
  Σ `usage.prompt_tokens_details.cached_tokens` / Σ `usage.prompt_tokens` over successful requests; a
  response without the field counts 0 cached, and the share is "not reported" (None) when no response
  had it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# metric -> (short name, section header) in vLLM's printed block.
_LABELS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(frozen=True, slots=True)
class TurnStats:
    """Turn `turn` (1-based) over all conversations. Latency and token figures are over its successful
    requests; `cached_token_share` is None when no successful request of the run reported cached_tokens."""

    turn: int
    completed: int
    failed: int
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_prompt_tokens: float
    cached_token_share: float | None


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. All times are `time.perf_counter()` seconds.

    Invariant: a successful record has at least one chunk time, and its token counts come from the
    server's usage chunk.
    """

    success: bool
    error: str
    send_time: float
    chunk_times: list[float]
    prompt_tokens: int
    completion_tokens: int
    generated_text: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time if self.chunk_times else 0.0

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.send_time if self.chunk_times else 0.0

    @property
    def itls(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


@dataclass(slots=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]


@dataclass(slots=True)
class BenchResult:
    """Aggregates of one timed run. `latency` holds the selected metrics in `METRIC_NAMES` order.

    `config` is the run's flags (argparse names; `metadata` is a dict of free-form KEY=VALUE notes);
    `environment` describes the client machine and the date. Both are filled by the client, and so is
    `turns` for a multi-turn run.
    """

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int | None  # None: no successful response reported cached_tokens
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency: dict[str, LatencyStats]
    records: list[RequestRecord]
    config: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    turns: list[TurnStats] = field(default_factory=list)  # per turn index, multi-turn runs only

    @property
    def cached_token_share(self) -> float | None:
        if self.total_cached_tokens is None:
            return None
        return self.total_cached_tokens / self.total_input_tokens if self.total_input_tokens else 0.0

    def to_json(self, detailed: bool = False) -> dict[str, Any]:
        """A dict with `vllm bench serve`'s result keys, plus `config` and `environment`."""
        config = _json_safe(self.config)
        out: dict[str, Any] = {
            "date": self.environment.get("date"),
            "backend": "openai-chat" if config.get("endpoint") == "/v1/chat/completions" else "openai",
            "endpoint": config.get("endpoint"),
            "model_id": config.get("model"),
            "num_prompts": config.get("num_prompts"),
            **(config.get("metadata") or {}),
            "request_rate": config.get("request_rate"),
            "burstiness": config.get("burstiness"),
            "max_concurrency": config.get("max_concurrency"),
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "total_cached_tokens": self.total_cached_tokens,
            "cached_token_share": self.cached_token_share,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        if detailed:
            out |= _detailed_lists(self.records)
        for name, stats in self.latency.items():
            out[f"mean_{name}_ms"] = stats.mean_ms
            out[f"median_{name}_ms"] = stats.median_ms
            out[f"std_{name}_ms"] = stats.std_ms
            for p, value in stats.percentiles_ms.items():
                out[f"p{_percentile_word(p)}_{name}_ms"] = value
        if self.turns:
            out["per_turn"] = [asdict(t) for t in self.turns]
        out["config"] = config
        out["environment"] = _json_safe(self.environment)
        return out


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            slo = float(value)
        except ValueError:
            slo = -1.0
        if not sep or name not in GOODPUT_METRICS or not slo >= 0:
            raise ValueError(
                f"--goodput {pair!r}: expected NAME:MILLISECONDS with NAME one of {', '.join(GOODPUT_METRICS)} "
                "and a non-negative number, e.g. --goodput ttft:500 tpot:50"
            )
        slos[name] = slo
    return slos


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    percentile_metrics: tuple[str, ...] = METRIC_NAMES,
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0),
    goodput_ms: dict[str, float] | None = None,
) -> BenchResult:
    """Aggregate a timed run of `duration_s` seconds. Failed records count only in `failed`."""
    ok = [r for r in records if r.success]
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [_tpot(r) for r in ok if r.completion_tokens > 1],
        "itl": [gap for r in ok for gap in r.itls],
        "e2el": [r.e2el for r in ok],
    }
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.completion_tokens for r in ok)
    cached_reported = any(r.cached_tokens is not None for r in ok)
    return BenchResult(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        total_cached_tokens=sum(r.cached_tokens or 0 for r in ok) if cached_reported else None,
        request_throughput=len(ok) / duration_s,
        request_goodput=None if not goodput_ms else _count_good(ok, goodput_ms) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=_peak_chunks_per_second(ok),
        max_concurrent_requests=_peak_concurrency(ok),
        latency={m: latency_stats(samples[m], percentiles) for m in METRIC_NAMES if m in percentile_metrics},
        records=records,
    )


def format_report(result: BenchResult) -> str:
    """vLLM's "Serving Benchmark Result" block."""
    rate = result.config.get("request_rate", math.inf)
    concurrency = result.config.get("max_concurrency")
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(f"{'Successful requests:':<40} {result.completed:<10}")
    lines.append(f"{'Failed requests:':<40} {result.failed:<10}")
    if concurrency is not None:
        lines.append(f"{'Maximum request concurrency:':<40} {concurrency:<10}")
    if rate != math.inf:
        lines.append(f"{'Request rate configured (RPS):':<40} {rate:<10.2f}")
    lines.append(f"{'Benchmark duration (s):':<40} {result.duration:<10.2f}")
    lines.append(f"{'Total input tokens:':<40} {result.total_input_tokens:<10}")
    lines.append(f"{'Total generated tokens:':<40} {result.total_output_tokens:<10}")
    lines.append(f"{'Cached prompt token share:':<40} {format_share(result.cached_token_share):<10}")
    lines.append(f"{'Request throughput (req/s):':<40} {result.request_throughput:<10.2f}")
    if result.request_goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40} {result.request_goodput:<10.2f}")
    lines.append(f"{'Output token throughput (tok/s):':<40} {result.output_throughput:<10.2f}")
    lines.append(f"{'Peak output token throughput (tok/s):':<40} {result.max_output_tokens_per_s:<10.2f}")
    lines.append(f"{'Peak concurrent requests:':<40} {result.max_concurrent_requests:<10.2f}")
    lines.append(f"{'Total token throughput (tok/s):':<40} {result.total_token_throughput:<10.2f}")
    for name, stats in result.latency.items():
        short, header = _LABELS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(f"{f'Mean {short} (ms):':<40} {stats.mean_ms:<10.2f}")
        lines.append(f"{f'Median {short} (ms):':<40} {stats.median_ms:<10.2f}")
        for p, value in stats.percentiles_ms.items():
            lines.append(f"{f'P{_percentile_word(p)} {short} (ms):':<40} {value:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def format_share(share: float | None) -> str:
    return "not reported" if share is None else f"{share:.2%}"


def _tpot(r: RequestRecord) -> float:
    return (r.e2el - r.ttft) / (r.completion_tokens - 1)


def latency_stats(values_s: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    return LatencyStats(
        mean_ms=float(np.mean(arr)),
        median_ms=float(np.median(arr)),
        std_ms=float(np.std(arr)),
        percentiles_ms={float(p): float(np.percentile(arr, p)) for p in percentiles},
    )


def _count_good(ok: list[RequestRecord], goodput_ms: dict[str, float]) -> int:
    """Requests meeting every SLO. A single-token request's TPOT counts as 0, as in vLLM."""

    def value_ms(r: RequestRecord, name: str) -> float:
        if name == "tpot":
            return _tpot(r) * 1000.0 if r.completion_tokens > 1 else 0.0
        return (r.ttft if name == "ttft" else r.e2el) * 1000.0

    return sum(all(value_ms(r, name) <= slo for name, slo in goodput_ms.items()) for r in ok)


def _peak_chunks_per_second(ok: list[RequestRecord]) -> float:
    """Most chunks arriving in one 1-second bucket counted from the earliest send.

    Each `choices` chunk counts as one token, exactly as vLLM's `max_output_tokens_per_s` does.
    """
    if not ok:
        return 0.0
    start = min(r.send_time for r in ok)
    end = max(r.send_time + r.e2el for r in ok)
    buckets = np.zeros(int(np.ceil(end - start)) + 1)
    for r in ok:
        for t in r.chunk_times:
            buckets[int(t - start)] += 1
    return float(buckets.max())


def _peak_concurrency(ok: list[RequestRecord]) -> int:
    """Peak overlap of the half-open intervals [send, last chunk); at equal times a departure goes first."""
    events = sorted([(r.send_time, 1) for r in ok] + [(r.send_time + r.e2el, -1) for r in ok])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def _detailed_lists(records: list[RequestRecord]) -> dict[str, list[Any]]:
    """Per-request lists under vLLM's `--save-detailed` names (seconds, in send order)."""
    return {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.completion_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itls for r in records],
        "latencies": [r.e2el for r in records],
        "start_times": [r.send_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "cached_tokens": [r.cached_tokens for r in records],
        "errors": [r.error for r in records],
    }


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _json_safe(value: Any) -> Any:
    """Non-finite floats become strings ("inf"), as vLLM writes `request_rate`; JSON has no infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
