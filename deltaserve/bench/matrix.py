"""`deltaserve bench matrix --group NAME`: one group of the standard matrix, start to record.

It writes the model's shape config (`make-tiny --config-only`), starts `deltaserve serve --load-format
dummy` on a free port and times process start -> HTTP ready, runs each cell's warm-up and then its timed
`bench serve` streams over HTTP, stops the server (SIGTERM, bounded wait), and writes
`<out>/<date>-<gpu>-<group>[-<tag>].md` and `.json`, with the raw `bench serve` results and all logs in
the directory of the same name. The record is rewritten after every cell, so a run cut short still
leaves what it measured. The start-up group instead starts the server twice (a first start and a
restart), timing HTTP ready and the first 1-token completion of each.

Exit status: 0 when every cell completed with 0 failed requests, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench import gpu_clocks
from deltaserve.bench.matrix_env import gpu_slug, nvidia_smi_field, probe_environment
from deltaserve.bench.matrix_plan import GROUPS, Cell, Group, Stream, select_cells
from deltaserve.bench.matrix_report import StreamSummary, render_markdown, summary_json
from deltaserve.bench.matrix_server import (
    ServerError,
    ServerProcess,
    first_completion_s,
    free_port,
    read_counter,
    start_server,
    stop_server,
    wait_graphs_ahead,
    wait_ready,
)
from deltaserve.bench.proc_stats import tree_cpu_seconds
from deltaserve.bench.records import PREVIOUS_RECORD_DATE, reference
from deltaserve.bench.step_log import write_report

# Every timed run reports p100 (the max) beside vLLM's percentiles.
_CLIENT_FLAGS = ("--metric-percentiles", "50,90,99,100", "--ready-check-timeout-sec", "60")
_DISPLAY_PYTHON = "python3"
_DISPLAY_PORT = 8000
# The server counter of recompute preemptions: a preempted stream pauses for its wait and prefill again.
PREEMPTIONS = "vllm:num_preemptions"
GRAPHS_AHEAD_TIMEOUT_S = 120.0  # the idle-time captures take ~8 s at the 4B shape on an H200


class Interrupted(Exception):
    """SIGTERM reached the runner: it stops the server and writes what it has."""


def add_bench_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    public = [g for g in GROUPS.values() if g.public]
    listing = "; ".join(f"{g.name} (~{g.expected_wall_s // 60 + 1} min)" for g in public)
    parser.add_argument("--group", required=True, metavar="NAME", help=f"one of: {listing}")
    parser.add_argument(
        "--cells", default=None, help="comma-separated cell names of the group to run (default: all)"
    )
    parser.add_argument("--out", default="docs/benchmarks", help="where the record is written")
    parser.add_argument(
        "--server-args",
        default="",
        help="extra `deltaserve serve` flags, after the group's (so they win), e.g. for an A/B run: "
        "--server-args='--max-num-seqs 512' (with '=': a value starting with '--' is otherwise read as a flag)",
    )
    parser.add_argument("--tag", default=None, help="appended to the record's name, e.g. max-seqs-512")
    parser.add_argument(
        "--work-dir", default=None, help="where make-tiny writes the shape config (default: a temp dir)"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=480.0, help="limit for HTTP ready")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and paths, run nothing")


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a group run executes, as argv lists; `display=True` gives the form printed in a record
    ($MODEL_DIR, $RAW, port 8000, python3) rather than this machine's paths."""

    group: Group
    python: str
    model_dir: Path
    out_dir: Path
    stem: str  # <date>-<gpu>-<group>[-<tag>]
    server_extra: tuple[str, ...]
    matrix_flags: tuple[str, ...]  # the `bench matrix` flags that reproduce the run

    @property
    def raw_dir(self) -> Path:
        return self.out_dir / self.stem

    def make_tiny_argv(self, display: bool = False) -> list[str]:
        model_dir = "$MODEL_DIR" if display else str(self.model_dir)
        return [*self._cli(display), "make-tiny", model_dir, "--preset", self.group.preset, "--config-only"]

    def server_flags(self) -> list[str]:
        flags = ["--load-format", "dummy", "--served-model-name", self.group.preset]
        return [*flags, *self.group.server_flags, *self.server_extra]

    def serve_argv(self, port: int | str, display: bool = False) -> list[str]:
        model_dir = "$MODEL_DIR" if display else str(self.model_dir)
        return [*self._cli(display), "serve", "--model", model_dir, "--port", str(port), *self.server_flags()]

    def bench_argv(
        self, cell: Cell, stream: Stream, url: str, warmup: bool, display: bool = False
    ) -> list[str]:
        # The client's own module: `deltaserve bench serve` without the engine's imports (torch).
        python = _DISPLAY_PYTHON if display else self.python
        argv = [python, "-m", "deltaserve.bench.serve", "--base-url", url, *_CLIENT_FLAGS]
        if warmup:
            return [*argv, *stream.warmup_flags]
        raw = "$RAW" if display else str(self.raw_dir)
        argv += [
            *stream.flags,
            "--save-result",
            "--result-dir",
            raw,
            "--result-filename",
            _file(cell, stream),
        ]
        return [*argv, "--metadata", f"group={self.group.name}", f"cell={cell.name}"]

    def matrix_command(self) -> str:
        return command_text([_DISPLAY_PYTHON, "-m", "deltaserve.cli", "bench", "matrix", *self.matrix_flags])

    def _cli(self, display: bool) -> list[str]:
        return [_DISPLAY_PYTHON if display else self.python, "-m", "deltaserve.cli"]


def run_bench_matrix(args: argparse.Namespace) -> int:
    if args.group not in GROUPS:
        public = ", ".join(n for n, g in GROUPS.items() if g.public)
        raise ValueError(f"--group {args.group!r} is not a group; choose one of {public}")
    group = select_cells(GROUPS[args.group], args.cells)
    date = datetime.now().strftime("%Y-%m-%d")
    if args.dry_run:
        plan = _plan(args, group, date, gpu_slug(nvidia_smi_field("name")))
        print(format_plan(plan))
        return 0
    env = probe_environment()
    plan = _plan(args, group, date, gpu_slug(env.get("gpu")))
    return GroupRun(plan, env, date, args.ready_timeout_s).run()


def _plan(args: argparse.Namespace, group: Group, date: str, slug: str) -> Plan:
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir()) / "deltaserve-matrix"
    out_dir = Path(args.out)
    flags = ["--group", group.name]
    if args.cells:
        flags += ["--cells", args.cells]
    if args.server_args:
        flags.append(f"--server-args={args.server_args}")
    if args.tag:
        flags += ["--tag", args.tag]
    return Plan(
        group=group,
        python=sys.executable,
        model_dir=work_dir / group.preset,
        out_dir=out_dir,
        stem=unique_stem(out_dir, record_stem(date, slug, group.name, args.tag)),
        server_extra=tuple(shlex.split(args.server_args)),
        matrix_flags=tuple(flags),
    )


def command_text(argv: list[str]) -> str:
    """A shell line; `$NAME` placeholders ($MODEL_DIR, $RAW, $PORT) stay unquoted so a shell expands them."""
    return " ".join(a if re.fullmatch(r"[\w@%+=:,./$-]+", a) else shlex.quote(a) for a in argv)


def record_stem(date: str, slug: str, group: str, tag: str | None = None) -> str:
    """`2026-12-05-h200-decode-4b`, with `-<tag>` when tagged."""
    return f"{date}-{slug}-{group}" + (f"-{tag}" if tag else "")


def unique_stem(out_dir: Path, stem: str) -> str:
    """`stem`, or `stem-2`, `stem-3`, ... when a record of that name exists: a record is never overwritten."""
    candidate, n = stem, 1
    while any((out_dir / f"{candidate}{suffix}").exists() for suffix in (".md", ".json", "")):
        n += 1
        candidate = f"{stem}-{n}"
    return candidate


def format_plan(plan: Plan) -> str:
    """What a run would execute, in order (the dry run)."""
    g = plan.group
    lines = [
        f"# bench matrix --group {g.name}: {g.model}, {len(g.cells)} cells, expected ~{g.expected_wall_s} s "
        "on one H200",
        f"# record: {plan.out_dir / plan.stem}.md and .json; raw results and logs in {plan.raw_dir}/",
        command_text(plan.make_tiny_argv()),
    ]
    url = "http://127.0.0.1:$PORT"
    server = command_text(plan.serve_argv("$PORT")) + "  # wait for GET /health 200"
    if g.startup:
        for cell in g.cells:
            lines += [f"# {cell.name}: {cell.title}", server, "# one 1-token completion, then SIGTERM"]
        return "\n".join(lines)
    lines.append(server)
    for cell in g.cells:
        lines.append(f"# {cell.name}: {cell.title}" + (" (streams at once)" if len(cell.streams) > 1 else ""))
        lines += [command_text(plan.bench_argv(cell, s, url, warmup=True)) for s in cell.streams]
        lines += [command_text(plan.bench_argv(cell, s, url, warmup=False)) for s in cell.streams]
    lines.append("# SIGTERM the server")
    return "\n".join(lines)


class GroupRun:
    """One execution of a plan; `record` is the JSON written (and rewritten) as it goes."""

    def __init__(self, plan: Plan, environment: dict[str, Any], date: str, ready_timeout_s: float) -> None:
        self.plan = plan
        self.ready_timeout_s = ready_timeout_s
        self.server: ServerProcess | None = None
        self.record = initial_record(plan, environment, date)

    def run(self) -> int:
        started = time.perf_counter()
        g = self.plan.group
        print(f"bench matrix {g.name}: {g.model}, expected ~{g.expected_wall_s} s", flush=True)
        self.plan.raw_dir.mkdir(parents=True, exist_ok=True)
        try:
            with _sigterm_raises():
                log = self.plan.raw_dir / "make-tiny.log"
                _run_logged(self.plan.make_tiny_argv(), log, timeout_s=600, what="make-tiny")
                if g.startup:
                    self._run_starts()
                else:
                    self._run_cells()
        except (ServerError, Interrupted, KeyboardInterrupt, RuntimeError) as exc:
            self.record["error"] = f"{type(exc).__name__}: {exc}"
            print(f"error: {self.record['error']}", file=sys.stderr, flush=True)
        finally:
            if self.server is not None:
                self.record["server"]["stop_s"] = stop_server(self.server)
                self.server = None
            self.record["wall_s"] = time.perf_counter() - started
            self._write()
            # A server run with DELTASERVE_ITL_DEBUG=1 logged its steps: their summary beside the log.
            write_report(self.plan.raw_dir / "server.log", self.plan.raw_dir / "bench-steps.txt")
        print(format_table(self.record))
        md = self.plan.out_dir / f"{self.plan.stem}.md"
        print(f"wrote {md} and {md.with_suffix('.json')}; raw results and logs in {self.plan.raw_dir}/")
        return 0 if record_ok(self.record) else 1

    def _run_cells(self) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.server = start_server(self.plan.serve_argv(port), url, self.plan.raw_dir / "server.log")
        self.record["server"]["ready_s"] = wait_ready(self.server, self.ready_timeout_s)
        print(f"server ready after {self.record['server']['ready_s']:.1f} s", flush=True)
        graphs = wait_graphs_ahead(self.server, GRAPHS_AHEAD_TIMEOUT_S)
        self.record["server"]["graphs_ahead_s"] = graphs
        if graphs is not None:
            print(f"graph captures ahead of need done after {graphs:.1f} s", flush=True)
        self._write()
        for cell, cell_record in zip(self.plan.group.cells, self.record["cells"], strict=True):
            self._run_cell(cell, cell_record, url)
            self._write()
            if self.server.proc.poll() is not None:
                raise ServerError(
                    f"the server exited with {self.server.proc.returncode}:\n{self.server.log_tail()}"
                )
        self.record["server"]["stop_s"] = stop_server(self.server)
        self.server = None

    def _run_cell(self, cell: Cell, cell_record: dict[str, Any], url: str) -> None:
        print(f"cell {cell.name}: {cell.title}", flush=True)
        raw = self.plan.raw_dir
        for stream, stream_record in zip(cell.streams, cell_record["streams"], strict=True):
            log = raw / _file(cell, stream, ".warmup.log")
            argv = self.plan.bench_argv(cell, stream, url, warmup=True)
            server_log_offset = self.server.log_size()
            (rc,) = _run_parallel([argv], [log], cell.timeout_s)
            if rc != 0:
                stream_record["error"] = self._failure("warm-up", rc, log, server_log_offset)
        if any(s["error"] for s in cell_record["streams"]):
            return
        argvs = [self.plan.bench_argv(cell, s, url, warmup=False) for s in cell.streams]
        logs = [raw / _file(cell, s, ".log") for s in cell.streams]
        preempted_before = read_counter(self.server, PREEMPTIONS)
        cpu_before, started = tree_cpu_seconds(self.server.proc.pid), time.perf_counter()
        server_log_offset = self.server.log_size()
        gpu_csv = raw / f"{cell.name}.gpu.csv"
        with gpu_clocks.sampled(gpu_csv):
            codes = _run_parallel(argvs, logs, cell.timeout_s)
        cell_record["host_cpu"] = host_cpu(cpu_before, tree_cpu_seconds(self.server.proc.pid), started)
        cell_record["preemptions"] = counter_change(preempted_before, read_counter(self.server, PREEMPTIONS))
        clocks = gpu_clocks.read_summary(gpu_csv)
        cell_record["gpu_clocks"] = asdict(clocks) if clocks is not None else None
        for stream, stream_record, rc, log in zip(
            cell.streams, cell_record["streams"], codes, logs, strict=True
        ):
            result = raw / _file(cell, stream)
            if rc != 0 or not result.exists():
                stream_record["error"] = self._failure("bench serve", rc, log, server_log_offset)
                continue
            summary = StreamSummary.from_bench_json(json.loads(result.read_text()))
            stream_record["summary"] = summary_json(summary)

    def _failure(self, what: str, rc: int | None, log: Path, server_log_offset: int) -> str:
        """A failed bench run in one line: how it ended, its first request error (else its last lines) and
        what the server logged at ERROR meanwhile, so that the record alone says why."""
        text = f"{what} {_exit_text(rc)}; see {log.name}: {_failure_text(log)}"
        server_errors = self.server.errors_since(server_log_offset)
        return text + (f"; the server logged: {' | '.join(server_errors)}" if server_errors else "")

    def _run_starts(self) -> None:
        """The start-up group: each cell is one server start, HTTP ready, one completion, SIGTERM."""
        for cell, cell_record in zip(self.plan.group.cells, self.record["cells"], strict=True):
            print(f"cell {cell.name}: {cell.title}", flush=True)
            port = free_port()
            log = self.plan.raw_dir / f"server-{cell.name}.log"
            self.server = start_server(self.plan.serve_argv(port), f"http://127.0.0.1:{port}", log)
            start: dict[str, Any] = {"ready_s": None, "first_response_s": None, "stop_s": None, "error": ""}
            try:
                start["ready_s"] = wait_ready(self.server, self.ready_timeout_s)
                start["first_response_s"] = first_completion_s(self.server, self.plan.group.preset)
            except ServerError as exc:
                start["error"] = str(exc)
            finally:
                start["stop_s"] = stop_server(self.server)
                self.server = None
            cell_record["startup"] = start
            self.record["server"]["ready_s"] = self.record["server"]["ready_s"] or start["ready_s"]
            self._write()

    def _write(self) -> None:
        out = self.plan.out_dir
        out.mkdir(parents=True, exist_ok=True)
        _write_atomic(out / f"{self.plan.stem}.json", json.dumps(self.record, indent=2) + "\n")
        _write_atomic(out / f"{self.plan.stem}.md", render_markdown(self.record))


def initial_record(plan: Plan, environment: dict[str, Any], date: str) -> dict[str, Any]:
    g = plan.group
    url = f"http://127.0.0.1:{_DISPLAY_PORT}"
    cells = []
    for cell in g.cells:
        ref = reference(g.preset, cell.name)
        streams = [
            {
                "name": s.name,
                "flags": list(s.flags),
                "warmup_command": command_text(plan.bench_argv(cell, s, url, warmup=True, display=True)),
                "command": command_text(plan.bench_argv(cell, s, url, warmup=False, display=True)),
                "result_file": _file(cell, s),
                "summary": None,
                "error": "",
            }
            for s in cell.streams
        ]
        cells.append(
            {
                "name": cell.name,
                "title": cell.title,
                "streams": streams,
                "startup": None,
                "host_cpu": None,
                "preemptions": None,
                "gpu_clocks": None,
                "floor": [asdict(f) | {"text": str(f)} for f in ref.floor],
                "previous": [asdict(f) | {"text": str(f)} for f in ref.previous],
                "note": ref.note,
            }
        )
    return {
        "group": g.name,
        "date": date,
        "model": g.model,
        "preset": g.preset,
        "expected_wall_s": g.expected_wall_s,
        "startup_group": g.startup,
        "command": plan.matrix_command(),
        "make_tiny_command": command_text(plan.make_tiny_argv(display=True)),
        "environment": environment,
        "server": {
            "flags": plan.server_flags(),
            "command": command_text(plan.serve_argv(_DISPLAY_PORT, display=True)),
            "ready_s": None,
            "graphs_ahead_s": None,
            "stop_s": None,
        },
        "cells": cells,
        "previous_record_date": PREVIOUS_RECORD_DATE,
        "raw_dir": plan.stem,
        "wall_s": None,
        "error": "",
    }


def host_cpu(
    before: dict[str, float] | None, after: dict[str, float] | None, started: float
) -> dict[str, float] | None:
    """CPU seconds the API server and its child processes (the engine) spent over a measured run,
    beside the run's wall time; None without /proc."""
    if before is None or after is None:
        return None
    wall = time.perf_counter() - started
    return {"wall_s": wall} | {f"{k}_s": max(after[k] - before[k], 0.0) for k in ("server", "engine")}


def counter_change(before: float | None, after: float | None) -> int | None:
    """How much a server counter rose over a measured run; None when either reading failed."""
    if before is None or after is None:
        return None
    return int(after - before)


def record_ok(record: dict[str, Any]) -> bool:
    """Every cell measured with 0 failed requests (or, for start-ups, started and answered)."""
    if record.get("error"):
        return False
    for cell in record["cells"]:
        if cell["streams"]:
            for s in cell["streams"]:
                if s["error"] or not s["summary"] or s["summary"]["failed"]:
                    return False
        elif not cell.get("startup") or cell["startup"]["error"]:
            return False
    return True


def format_table(record: dict[str, Any]) -> str:
    """The short table printed at the end of a run (the markdown has the full figures)."""
    gpu = record["environment"].get("gpu") or "CPU"
    lines = [
        f"{record['group']} on {gpu}: server ready {_s(record['server'].get('ready_s'))}, wall {_s(record.get('wall_s'))}"
    ]
    if record["startup_group"]:
        lines.append(f"{'cell':<16} {'HTTP ready':>11} {'1st token':>10} {'stop':>7}  error")
        for c in record["cells"]:
            st = c["startup"] or {}
            lines.append(
                f"{c['name']:<16} {_s(st.get('ready_s')):>11} {_s(st.get('first_response_s')):>10} "
                f"{_s(st.get('stop_s')):>7}  {st.get('error', '')[:60]}"
            )
        return "\n".join(lines)
    lines.append(
        f"{'cell':<24} {'ok/fail':>9} {'TTFT med':>9} {'TPOT med':>9} {'ITL p99':>8} {'ITL max':>8} "
        f"{'out tok/s':>10} {'tot tok/s':>10}"
    )
    for c in record["cells"]:
        for s in c["streams"]:
            name = c["name"] + (f"/{s['name']}" if s["name"] else "")
            if not s["summary"]:
                lines.append(f"{name:<24} FAILED: {s['error'][:80]}")
                continue
            m = StreamSummary.from_record(s["summary"])
            lines.append(
                f"{name:<24} {f'{m.completed}/{m.failed}':>9} {m.ttft_ms.median:>9.2f} {m.tpot_ms.median:>9.2f} "
                f"{m.itl_ms.p99:>8.2f} {m.itl_ms.max:>8.2f} {m.output_tok_s:>10.1f} {m.total_tok_s:>10.1f}"
            )
    if record.get("error"):
        lines.append(f"run error: {record['error'][:200]}")
    return "\n".join(lines)


def _file(cell: Cell, stream: Stream, suffix: str = ".json") -> str:
    return f"{cell.name}{'-' + stream.name if stream.name else ''}{suffix}"


def _run_logged(argv: list[str], log: Path, timeout_s: float, what: str) -> None:
    (rc,) = _run_parallel([argv], [log], timeout_s)
    if rc != 0:
        raise RuntimeError(f"{what} {_exit_text(rc)}: {command_text(argv)}; its log ends: {_tail(log)}")


def _run_parallel(argvs: list[list[str]], logs: list[Path], timeout_s: float) -> list[int | None]:
    """Run the commands at the same time, each logging to its file; exit codes, None for one killed at
    the deadline. Children still running when this returns (an interrupt) are killed."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv, log in zip(argvs, logs, strict=True):
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                codes.append(None)
        return codes
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _exit_text(rc: int | None) -> str:
    return "ran past its time limit and was killed" if rc is None else f"exited with {rc}"


def _failure_text(log: Path) -> str:
    """What a failed bench serve said: its first failed request's error (printed before its report),
    else its last lines."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    first_error = next((line for line in lines if line.startswith("Error 0: ")), None)
    return first_error or " | ".join(lines[-5:])


def _tail(log: Path, lines: int = 5) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While running, SIGTERM raises Interrupted so the server is stopped and the record written."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
