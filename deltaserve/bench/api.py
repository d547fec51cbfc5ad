"""`deltaserve bench api`: what the API process costs per streamed token, on any machine.

It starts the API server over a synthetic engine (bench/synthetic_engine.py: one token per running
request every `--step-ms`, no model), loads it with `bench serve` (every bench serve flag applies; the
server's URL is its own) and reads the API process's CPU time over the measured run from /proc. The
engine's rate is known, so what the clients miss of it (TPOT above the step, ITL tails) is the API
process's doing: its event loop, detokenization, the endpoints and SSE.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deltaserve.bench.matrix_server import (
    ServerError,
    first_completion_s,
    free_port,
    start_server,
    stop_server,
    wait_ready,
)
from deltaserve.bench.proc_stats import tree_cpu_seconds
from deltaserve.bench.serve import add_bench_serve_arguments, run_bench_serve

READY_TIMEOUT_S = 120.0


def _positive_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of milliseconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def add_step_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--step-ms", type=_positive_ms, default=5.0, help="one token per running request per step"
    )


def add_bench_api_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_serve_arguments(parser)
    api = parser.add_argument_group("synthetic engine")
    add_step_argument(api)
    api.add_argument(
        "--max-num-seqs", type=_positive_int, default=256, help="requests the engine runs at once"
    )
    api.add_argument(
        "--server-args",
        default="",
        help="further `deltaserve serve` flags for the API server, e.g. '--model DIR' for its tokenizer",
    )


@dataclass(frozen=True, slots=True)
class ApiProcessCost:
    cpu_s: float  # user + system CPU of the API server processes (all of them) over the measured run
    wall_s: float
    output_tokens: int

    @property
    def us_per_token(self) -> float:
        return self.cpu_s / self.output_tokens * 1e6 if self.output_tokens else 0.0

    @property
    def core_share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0


def format_api_cost(cost: ApiProcessCost, step_ms: float, max_num_seqs: int) -> str:
    lines = [
        "{s:{c}^50}".format(s=" API process (synthetic engine) ", c="="),
        f"{'Engine step (ms):':<40}{step_ms:<10.2f}",
        f"{'Engine rows at once:':<40}{max_num_seqs:<10}",
        f"{'API process CPU (s):':<40}{cost.cpu_s:<10.2f}",
        f"{'API process share of one core (%):':<40}{cost.core_share * 100:<10.1f}",
        f"{'API process CPU per output token (us):':<40}{cost.us_per_token:<10.1f}",
        "=" * 50,
    ]
    return "\n".join(lines)


def run_bench_api(args: argparse.Namespace) -> int:
    port = free_port()
    args.base_url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "deltaserve.cli",
        "bench",
        "api-server",
        "--step-ms",
        str(args.step_ms),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--port",
        str(port),
        *shlex.split(args.server_args),
    ]
    # The server's log goes with the results, or to a temporary folder kept only when the run fails.
    scratch = None if args.result_dir else tempfile.mkdtemp(prefix="deltaserve-bench-api-")
    log_dir = Path(args.result_dir or scratch)
    server = start_server(argv, args.base_url, log_dir / "api-server.log")
    try:
        wait_ready(server, READY_TIMEOUT_S)
        first_completion_s(server, args.model)  # routes warm
        before = tree_cpu_seconds(server.proc.pid)
        result = run_bench_serve(args)
        after = tree_cpu_seconds(server.proc.pid)
    except ServerError as exc:
        print(f"error: {exc} (server log: {log_dir / 'api-server.log'})", file=sys.stderr)
        return 1
    finally:
        stop_server(server)
    if scratch is not None and result.completed and not result.failed:
        shutil.rmtree(scratch, ignore_errors=True)
    if before is None or after is None:
        print("the API process's CPU time cannot be read here (no /proc)", file=sys.stderr)
        return 0 if result.completed else 1
    cost = ApiProcessCost(after["server"] - before["server"], result.duration, result.total_output_tokens)
    print(format_api_cost(cost, args.step_ms, args.max_num_seqs))
    return 0 if result.completed else 1
