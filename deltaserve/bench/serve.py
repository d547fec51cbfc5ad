"""`deltaserve bench serve`: a streaming load generator for OpenAI-compatible servers.

Flags, request payloads, arrival process and metrics follow `vllm bench serve`, so a result from this
client compares with one from vLLM's client against the same server. Run as
`deltaserve bench serve ...` or `python -m deltaserve.bench.serve ...`.

Datasets: `random` (token-id prompts of fixed lengths), `custom` (JSONL) and `multi-turn` (chat
conversations sharing a system prompt, multi_turn.py), which reports a per-turn table as well.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import numpy as np

from deltaserve.bench.client import Endpoint, first_model, send, wait_for_health
from deltaserve.bench.datasets import (
    QWEN35_BASE_VOCAB_SIZE,
    BenchRequest,
    load_custom_jsonl,
    random_token_prompts,
)
from deltaserve.bench.metrics import (
    METRIC_NAMES,
    BenchResult,
    RequestRecord,
    compute_metrics,
    format_report,
    parse_goodput,
)
from deltaserve.bench.multi_turn import MultiTurnDataset, converse, multi_turn_dataset
from deltaserve.bench.turn_metrics import format_turn_table, per_turn_stats
from deltaserve.bench.worst_gap import worst_gap, worst_gap_line
from deltaserve.heap import collections_paused

# One request may legitimately stream for a long time (long outputs under heavy load); vLLM's bound.
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
_MAX_ERRORS_SHOWN = 10
_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"
# vLLM's `bench serve` sampling flags besides --temperature, as the request fields they set.
SAMPLING_FLAGS: dict[str, type] = {
    "--top-p": float,
    "--top-k": int,
    "--min-p": float,
    "--repetition-penalty": float,
    "--frequency-penalty": float,
    "--presence-penalty": float,
}
T = TypeVar("T")


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vllm bench serve` that this client implements, with the same names and defaults."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    server.add_argument(
        "--endpoint",
        default=None,
        choices=[_COMPLETIONS, _CHAT],
        help=f"API endpoint to stream from (default: {_CHAT} for multi-turn, else {_COMPLETIONS})",
    )
    server.add_argument("--model", default=None, help="model name; default: the first id of GET /v1/models")
    server.add_argument("--api-key", default=None, help="bearer token; default: $OPENAI_API_KEY if set")
    server.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=600.0,
        help="wait this long for GET /health to answer 200 before the run; 0 skips the check",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=["random", "custom", "multi-turn"])
    data.add_argument(
        "--dataset-path",
        default=None,
        help='custom dataset: JSONL lines {"prompt": str | list[int], "output_len": int}',
    )
    data.add_argument(
        "--num-prompts", type=int, default=1000, help="requests to send (multi-turn: conversations)"
    )
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len·(1−r), len·(1+r)]; 0 = fixed lengths",
    )
    data.add_argument("--random-token-id-low", type=int, default=0, help="smallest prompt token id")
    data.add_argument(
        "--random-token-id-high",
        type=int,
        default=QWEN35_BASE_VOCAB_SIZE,
        help="prompt token ids stay below this (default: Qwen3.5's vocabulary without special tokens)",
    )

    multi = parser.add_argument_group(
        "multi-turn dataset",
        "Conversations over /v1/chat/completions that all open with one system prompt; each turn sends "
        "the whole history (earlier user messages and the answers the server returned) plus a new user "
        "message. --num-prompts counts conversations, --max-concurrency caps conversations in flight and "
        "--request-rate is conversation starts per second. Lengths are in tokens of the Qwen3.5 "
        "vocabulary (texts of one-token words; approximate under another tokenizer).",
    )
    multi.add_argument(
        "--multi-turn-num-turns",
        type=int,
        default=10,
        metavar="T",
        help="turns per conversation (default 10)",
    )
    multi.add_argument(
        "--multi-turn-system-prompt-len",
        type=int,
        default=2000,
        metavar="S",
        help="tokens of the system prompt every conversation shares (default 2000; 0: no system message)",
    )
    multi.add_argument(
        "--multi-turn-user-len",
        type=int,
        default=200,
        metavar="U",
        help="tokens of each user message (default 200)",
    )
    multi.add_argument(
        "--multi-turn-output-len",
        type=int,
        default=128,
        metavar="O",
        help="tokens of each answer (default 128; exact with ignore_eos, on by default)",
    )
    multi.add_argument(
        "--multi-turn-enable-thinking",
        action="store_true",
        help="leave thinking to the server's default; by default requests send chat_template_kwargs "
        '{"enable_thinking": false}, so the whole answer is content and goes back into the history',
    )

    traffic = parser.add_argument_group("traffic")
    traffic.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second; inf sends all at once, otherwise gamma/Poisson arrivals",
    )
    traffic.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 more uniform",
    )
    traffic.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (multi-turn: on conversations in flight)",
    )
    traffic.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not measured")
    traffic.add_argument("--seed", type=int, default=0)

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos so every request generates its full length (default: on for random and "
        "multi-turn)",
    )
    sampling.add_argument("--temperature", type=float, default=0.0)
    for flag, kind in SAMPLING_FLAGS.items():
        sampling.add_argument(flag, type=kind, default=None, help="sent with every request when given")
    sampling.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        help='a JSON object merged into every request\'s body (e.g. \'{"structured_outputs": {"regex": '
        '"[a-z ]+"}}\')',
    )

    report = parser.add_argument_group("report")
    report.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES))
    report.add_argument("--metric-percentiles", default="50,90,99")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs a request must all meet to count as good, e.g. ttft:500 tpot:50 e2el:10000",
    )
    report.add_argument("--save-result", action="store_true", help="write the result JSON")
    report.add_argument(
        "--save-detailed", action="store_true", help="also write per-request lists (ttfts, itls, errors)"
    )
    report.add_argument("--result-dir", default=None)
    report.add_argument("--result-filename", default=None)
    report.add_argument(
        "--metadata",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="notes stored in the result JSON, e.g. gpu=H100 server_flags='--max-num-seqs 256'",
    )


def run_bench_serve(args: argparse.Namespace) -> BenchResult:
    """Run one benchmark as `args` describe, print vLLM's report block, save JSON if asked."""
    return asyncio.run(_bench(args))


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send time of each request in seconds after the start, as `vllm bench serve` schedules them.

    Finite rates draw gamma inter-arrival gaps (shape = burstiness, mean = 1/rate) and rescale their
    running sum so the last request starts at exactly num_requests/rate, so throughput does not drift by
    the 1-2% sampling error between seeds.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate ({request_rate}) and --burstiness ({burstiness}) must be positive")
    if request_rate == math.inf:
        return [0.0] * num_requests
    if burstiness == math.inf:
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    return (times * (num_requests / request_rate / times[-1])).tolist()


async def _bench(args: argparse.Namespace) -> BenchResult:
    _validate(args)
    goodput = parse_goodput(args.goodput) if args.goodput else None
    percentile_metrics = _parse_metric_names(args.percentile_metrics)
    percentiles = _parse_percentiles(args.metric_percentiles)
    endpoint_path = _endpoint_path(args)
    workload = _load_workload(args, chat=endpoint_path == _CHAT)
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name != "custom"
    base_url = args.base_url.rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    num_jobs = len(workload.conversations) if isinstance(workload, MultiTurnDataset) else len(workload)
    offsets = arrival_offsets(num_jobs, args.request_rate, args.burstiness, np.random.default_rng(args.seed))

    # limit=0 lifts aiohttp's default pool cap of 100 connections, which would silently cap concurrency.
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector, timeout=_REQUEST_TIMEOUT) as session:
        await wait_for_health(session, base_url, args.ready_check_timeout_sec)
        model = args.model or await first_model(session, base_url, headers)
        endpoint = Endpoint(
            session,
            base_url + endpoint_path,
            headers,
            model,
            endpoint_path == _CHAT,
            ignore_eos,
            args.temperature,
            _chat_template_kwargs(args),
            sampling_fields(args),
        )
        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...")
            await _warm_up(endpoint, workload, args)
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness}")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        with collections_paused():  # a collection here would be timed as the server's gap
            start = time.perf_counter()
            turns = await _run_workload(endpoint, workload, offsets, args.max_concurrency)
            duration = time.perf_counter() - start

    records = [record for _, record in turns]
    result = compute_metrics(records, duration, percentile_metrics, percentiles, goodput)
    if isinstance(workload, MultiTurnDataset):
        result.turns = per_turn_stats(turns)
    result.config = _config(args, model, ignore_eos, endpoint_path)
    result.environment = _environment()
    _print_errors(records)
    print(format_report(result))
    gap = worst_gap(records)
    print(worst_gap_line(gap))
    if result.turns:
        print(format_turn_table(result.turns))
    if args.save_result:
        path = _result_path(args, model, result.environment["date"])
        saved = result.to_json(detailed=args.save_detailed)
        saved["worst_itl_gap"] = asdict(gap) if gap is not None else None
        path.write_text(json.dumps(saved, indent=2) + "\n")
        print(f"Saved result to {path}")
    return result


async def _run_workload(
    endpoint: Endpoint,
    workload: list[BenchRequest] | MultiTurnDataset,
    offsets: list[float] | None,
    max_concurrency: int | None,
) -> list[tuple[int, RequestRecord]]:
    """(turn index, record) per request in send order per job; the turn index is 1 outside multi-turn."""
    if isinstance(workload, MultiTurnDataset):
        jobs = [partial(converse, endpoint, workload, c) for c in workload.conversations]
        conversations = await _run_scheduled(jobs, offsets, max_concurrency)
        return [(t.turn, t.record) for turns in conversations for t in turns]
    records = await _run_scheduled([partial(send, endpoint, r) for r in workload], offsets, max_concurrency)
    return [(1, r) for r in records]


async def _warm_up(
    endpoint: Endpoint, workload: list[BenchRequest] | MultiTurnDataset, args: argparse.Namespace
) -> None:
    """`--num-warmups` requests, not measured: the first prompt repeated, as vLLM does; for multi-turn,
    first turns of conversations drawn with another seed, so they share nothing with the timed run."""
    if isinstance(workload, MultiTurnDataset):
        warm = _multi_turn(args, num_conversations=args.num_warmups, num_turns=1, seed=args.seed + 1)
    else:
        warm = [workload[0]] * args.num_warmups
    await _run_workload(endpoint, warm, None, args.max_concurrency)


async def _run_scheduled(
    jobs: list[Callable[[], Awaitable[T]]],
    offsets: list[float] | None,
    max_concurrency: int | None,
) -> list[T]:
    """Start job i at `offsets[i]` seconds (all at once if None); at most `max_concurrency` run at once.

    A job waiting on the cap starts (and its TTFT clock with it) only once it holds a slot, as in vLLM.
    """
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def limited(job: Callable[[], Awaitable[T]]) -> T:
        async with limit:
            return await job()

    start = time.perf_counter()
    tasks = []
    for i, job in enumerate(jobs):
        delay = start + offsets[i] - time.perf_counter() if offsets else 0.0
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(job)))
    return list(await asyncio.gather(*tasks))


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")


def _endpoint_path(args: argparse.Namespace) -> str:
    if args.dataset_name != "multi-turn":
        return args.endpoint or _COMPLETIONS
    if args.endpoint not in (None, _CHAT):
        raise ValueError(f"--dataset-name multi-turn sends chat messages; use --endpoint {_CHAT}")
    return _CHAT


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields of the sampling flags given (the server's defaults apply to the others), then
    those of --extra-body."""
    names = [flag.removeprefix("--").replace("-", "_") for flag in SAMPLING_FLAGS]
    fields: dict[str, Any] = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return fields | (getattr(args, "extra_body", None) or {})


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object, got {text!r} ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object, got {text!r}")
    return value


def _chat_template_kwargs(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.dataset_name != "multi-turn" or args.multi_turn_enable_thinking:
        return None
    return {"enable_thinking": False}


def _load_workload(args: argparse.Namespace, chat: bool) -> list[BenchRequest] | MultiTurnDataset:
    if args.dataset_name == "multi-turn":
        return _multi_turn(args, args.num_prompts, args.multi_turn_num_turns, args.seed)
    requests = _load_requests(args)
    if chat and any(isinstance(r.prompt, list) for r in requests):
        raise ValueError(
            f"{_CHAT} takes text, but the prompts are token ids; "
            f"use --endpoint {_COMPLETIONS} or a custom dataset with text prompts"
        )
    return requests


def _multi_turn(
    args: argparse.Namespace, num_conversations: int, num_turns: int, seed: int
) -> MultiTurnDataset:
    if args.dataset_path:
        raise ValueError(
            "--dataset-path is read only with --dataset-name custom; multi-turn texts are generated"
        )
    return multi_turn_dataset(
        num_conversations,
        num_turns,
        args.multi_turn_system_prompt_len,
        args.multi_turn_user_len,
        args.multi_turn_output_len,
        seed,
    )


def _load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset_name == "random":
        if args.dataset_path:
            raise ValueError(
                "--dataset-path is read only with --dataset-name custom; the random set is generated"
            )
        return random_token_prompts(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            args.random_token_id_low,
            args.random_token_id_high,
        )
    if not args.dataset_path:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
    return load_custom_jsonl(args.dataset_path, args.num_prompts)


def _parse_metric_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {','.join(METRIC_NAMES)}")
    return names


def _parse_percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(p) for p in text.split(",") if p.strip())
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be comma-separated numbers in [0, 100], got {text!r}")
    return values


def _config(args: argparse.Namespace, model: str, ignore_eos: bool, endpoint: str) -> dict[str, Any]:
    """The run's flags as resolved. The API key is left out; values that are not data (e.g. a subcommand
    handler set by the main CLI) are dropped."""
    plain = (str, int, float, bool, list, type(None))
    config = {k: v for k, v in vars(args).items() if k != "api_key" and isinstance(v, plain)}
    config |= {"model": model, "endpoint": endpoint, "ignore_eos": ignore_eos}
    config["metadata"] = _parse_metadata(args.metadata)
    return config


def _parse_metadata(items: list[str] | None) -> dict[str, str]:
    metadata = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        metadata[key.strip()] = value.strip()
    return metadata


def _environment() -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "client_python": platform.python_version(),
        "client_platform": platform.platform(),
        "client_commit": _git_commit(),
        "aiohttp": aiohttp.__version__,
        "numpy": np.__version__,
    }


def _git_commit() -> str | None:
    """The deltaserve checkout's commit, or None outside a git checkout."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _result_path(args: argparse.Namespace, model: str, date: str) -> Path:
    """vLLM's default name: `{label}-{rate}qps[-concurrency{c}]-{model}-{date}.json`."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = (
        args.result_filename
        or f"deltaserve-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"
    )
    directory = Path(args.result_dir or ".")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def _print_errors(records: list[RequestRecord]) -> None:
    failed = [r for r in records if not r.success]
    if failed:
        print(f"Failed requests during benchmark run detected (capping to {_MAX_ERRORS_SHOWN}):")
        for i, r in enumerate(failed[:_MAX_ERRORS_SHOWN]):
            print(f"Error {i}: {r.error}")


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when at least one request completed, as `deltaserve bench serve`."""
    parser = argparse.ArgumentParser(
        prog="deltaserve bench serve", description="Benchmark a running server with streaming requests."
    )
    add_bench_serve_arguments(parser)
    return 0 if run_bench_serve(parser.parse_args(argv)).completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
