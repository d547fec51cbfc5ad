"""Prometheus metrics with vLLM's names (`vllm:*`, labelled `model_name`), on a dedicated registry.

Latencies are measured in the API server from the request's arrival (before tokenization), as vLLM does:
TTFT = first output token - arrival; ITL = gap between successive output tokens of one request (a
delta of k tokens counts k gaps of a k-th of its interval);
e2e = terminal - arrival; queue time = the engine's admission of the request (the tick that plans its first
chunk) - its submission to the engine, as vLLM's engine measures it. Load gauges (running,
waiting, KV use, preemptions, prefix-cache queries and hits in tokens) are read from the engine's latest
LoadSnapshot at scrape time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deltaserve import itl_debug
from deltaserve.engine.protocol import LoadSnapshot
from deltaserve.server.metrics_processes import MULTIPROCESS_ENV

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class _LoadCollector(Collector):
    def __init__(self, model_name: str, load: Callable[[], LoadSnapshot]) -> None:
        self._model_name = model_name
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Requests holding a state slot (prefilling or decoding).",
                load.running,
            ),
            ("vllm:num_requests_waiting", "Requests queued for admission.", load.waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).", load.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self._model_name], float(value))
            yield gauge
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Preemptions by recompute since start.", labels=["model_name"]
        )
        preemptions.add_metric([self._model_name], float(load.num_preemptions))
        yield preemptions
        for name, doc, value in (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                load.prefix_cache_queries,
            ),
            ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", load.prefix_cache_hits),
            (
                "vllm:spec_decode_num_drafts",
                "Speculative verify rows (one per decoder and step).",
                load.spec_num_drafts,
            ),
            (
                "vllm:spec_decode_num_draft_tokens",
                "Draft tokens the target verified.",
                load.spec_num_draft_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens the target accepted.",
                load.spec_num_accepted_tokens,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self._model_name], float(value))
            yield counter
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0: a row's first draft).",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(load.spec_accepted_per_position):
            per_position.add_metric([self._model_name, str(position)], float(value))
        yield per_position


@dataclass(slots=True)
class TokenTotals:
    """Plain running totals, for the periodic log line."""

    prompt: int = 0
    generation: int = 0


class ServerMetrics:
    def __init__(self, model_name: str, load: Callable[[], LoadSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.totals = TokenTotals()
        labels = {"model_name": model_name}
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], registry=r, buckets=buckets).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS
        )
        self.queue = histogram("vllm:request_queue_time_seconds", "Time spent queued.", REQUEST_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.shed = counter(
            "deltaserve:requests_shed",
            "Requests refused with 503 because the queue was full (--max-queued-requests).",
        )
        self._model_name = model_name
        load_collector = _LoadCollector(model_name, load)
        r.register(load_collector)
        # With several API server processes (prometheus_client's multiprocess mode, set up before this
        # module's first import): every process's request metrics summed, and the engine's load.
        self._rendered = r
        if os.environ.get(MULTIPROCESS_ENV):
            self._rendered = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._rendered)
            self._rendered.register(load_collector)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=finish_reason).inc()

    def track(self, arrival: float) -> RequestTracker:
        """A request's bookkeeping from its submission to the engine (now) on."""
        return RequestTracker(self, arrival, submitted=time.monotonic())

    def render(self) -> bytes:
        return generate_latest(self._rendered)


def log_first_token(
    arrival: float, submitted: float, queued_time: float | None, first_token: float, prompt_tokens: int
) -> None:
    """The latency log's line for a request's first token (DELTASERVE_ITL_DEBUG=1), in µs on the
    monotonic clock the engine's step lines use: `mono_us` the token's arrival here (detokenized, before
    the response writes it), `arrival_us` the HTTP request's, `submitted_us` when parsed and tokenized it
    went to the engine, `queued_us` from there to the engine's first step with it (-1: not reported)."""
    itl_debug.logger.info(
        "ITL_REQ mono_us=%d arrival_us=%d submitted_us=%d queued_us=%d prompt_tokens=%d",
        int(first_token * 1e6),
        int(arrival * 1e6),
        int(submitted * 1e6),
        -1 if queued_time is None else int(max(queued_time, 0.0) * 1e6),
        prompt_tokens,
    )


@dataclass(slots=True)
class RequestTracker:
    """One request's latency bookkeeping. Exactly one `finish` per request (later calls are ignored)."""

    metrics: ServerMetrics
    arrival: float  # time.monotonic() when the HTTP request arrived
    last_token: float | None = None
    finished: bool = field(default=False)
    submitted: float = 0.0  # time.monotonic() when, parsed and tokenized, it went to the engine

    def on_tokens(self, num_tokens: int, num_prompt_tokens: int, queued_time: float | None) -> None:
        if num_tokens == 0 or self.finished:
            return
        t = time.monotonic()
        m = self.metrics
        if self.last_token is None:
            m.ttft.observe(t - self.arrival)
            m.prompt_tokens.inc(num_prompt_tokens)
            m.totals.prompt += num_prompt_tokens
            if queued_time is not None:
                m.queue.observe(max(queued_time, 0.0))
            if itl_debug.ITL_DEBUG:
                log_first_token(self.arrival, self.submitted, queued_time, t, num_prompt_tokens)
        else:
            # A delta of several tokens (a stream interval, a consumer catching up, speculative tokens)
            # counts each at the mean gap, so the histogram does not depend on how tokens were batched.
            gap = (t - self.last_token) / num_tokens
            for _ in range(num_tokens):
                m.itl.observe(gap)
        self.last_token = t
        m.generation_tokens.inc(num_tokens)
        m.totals.generation += num_tokens

    def finish(self, finish_reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.request_finished(finish_reason)
