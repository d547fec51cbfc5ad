"""A matrix run's record: the summary of each `bench serve` result, and the markdown written from the
record's JSON (docs/benchmarks/<date>-<gpu>-<group>.md beside <...>.json).

Latencies are `bench serve`'s (vLLM's definitions), as mean / median / p99 / max in ms; max is the
100th percentile of the same samples. The JSON is the source: `render_markdown` reads only it.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any

from deltaserve.bench import gpu_clocks
from deltaserve.bench.metrics import format_share

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Spread:
    mean: float
    median: float
    p99: float
    max: float


@dataclass(frozen=True, slots=True)
class StreamSummary:
    """The figures a record keeps from one `bench serve` result JSON."""

    completed: int
    failed: int
    duration_s: float
    ttft_ms: Spread
    tpot_ms: Spread
    itl_ms: Spread
    e2el_ms: Spread
    output_tok_s: float
    total_tok_s: float
    max_concurrent_requests: int
    cached_token_share: float | None
    per_turn: tuple[dict[str, Any], ...] = ()
    worst_itl_gap: dict[str, Any] | None = None  # bench/worst_gap.py WorstGap, as saved

    @classmethod
    def from_bench_json(cls, result: dict[str, Any]) -> StreamSummary:
        """From `bench serve --save-result` output run with --metric-percentiles including 99 and 100."""

        def spread(metric: str) -> Spread:
            return Spread(*(float(result[f"{s}_{metric}_ms"]) for s in ("mean", "median", "p99", "p100")))

        return cls(
            completed=result["completed"],
            failed=result["failed"],
            duration_s=result["duration"],
            ttft_ms=spread("ttft"),
            tpot_ms=spread("tpot"),
            itl_ms=spread("itl"),
            e2el_ms=spread("e2el"),
            output_tok_s=result["output_throughput"],
            total_tok_s=result["total_token_throughput"],
            max_concurrent_requests=result["max_concurrent_requests"],
            cached_token_share=result.get("cached_token_share"),
            per_turn=tuple(result.get("per_turn") or ()),
            worst_itl_gap=result.get("worst_itl_gap"),
        )

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> StreamSummary:
        """The inverse of `dataclasses.asdict` (what the record JSON holds)."""
        fields = dict(data)
        for metric in LATENCY_METRICS:
            fields[f"{metric}_ms"] = Spread(**data[f"{metric}_ms"])
        fields["per_turn"] = tuple(data.get("per_turn") or ())
        return cls(**fields)

    def value(self, metric: str) -> float:
        """`metric` as "tpot_ms.median" (a Spread field) or "total_tok_s" (a plain field)."""
        name, _, stat = metric.partition(".")
        value = getattr(self, name)
        return getattr(value, stat) if stat else value


def summary_json(summary: StreamSummary) -> dict[str, Any]:
    return dataclasses.asdict(summary)


def render_markdown(record: dict[str, Any]) -> str:
    """The markdown record of one group run, from its JSON."""
    env = record["environment"]
    startup = record["startup_group"]
    intro = (
        "Start-up times, taken by `deltaserve bench matrix`: from spawning `deltaserve serve` to the first "
        "200 of GET /health, and to the return of a first 1-token completion."
        if startup
        else "Serving numbers: every figure comes from `deltaserve bench serve` over HTTP against "
        "`deltaserve serve`, with the definitions of `vllm bench serve`."
    )
    lines = [
        f"# {record['date']} {env.get('gpu') or 'CPU'}: {record['group']}",
        "",
        intro,
        "",
        *_header_table(record),
        "",
    ]
    if record.get("error"):
        lines += ["**The run did not finish:**", "", "```text", record["error"], "```", ""]
    if startup:
        lines += _startup_section(record)
    else:
        lines += _results_section(record)
    lines += _turn_sections(record)
    lines += _reproduce_section(record)
    return "\n".join(lines) + "\n"


def tensor_parallel_size(flags: list[str]) -> int:
    """The GPUs a server started with these flags uses: its --tensor-parallel-size (or -tp), else 1."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    known, _ = parser.parse_known_args(flags)
    return known.tensor_parallel_size


def _bytecode(env: dict[str, Any]) -> str | None:
    """Whether imports compile from source: a start-up time depends on it by seconds (torch alone is
    ~2,000 modules), and an installed environment has the bytecode."""
    total, compiled = env.get("torch_modules"), env.get("torch_modules_compiled")
    if not total or compiled is None:
        return None
    writes = env.get("writes_bytecode")
    text = f"torch's modules byte-compiled: {compiled:,} of {total:,}"
    if writes is not None:
        text += "; the interpreter writes bytecode" if writes else "; the interpreter writes none"
    if compiled < total / 2:
        text += " (imports compile from source: start-up times are not an installed environment's)"
    return text


def _header_table(record: dict[str, Any]) -> list[str]:
    env, server = record["environment"], record["server"]
    gpu = env.get("gpu") or "none (CPU)"
    if env.get("gpu_memory_mib"):
        gpu += f" ({env['gpu_memory_mib']} MiB)"
    if env.get("gpu_count") and env["gpu_count"] > 1:
        used = tensor_parallel_size(server["flags"])
        gpu += f", {env['gpu_count']} visible (the server uses {'one' if used == 1 else used})"
    if env.get("driver"):
        gpu += f", driver {env['driver']}"
    software = ", ".join(
        f"{name} {env[key]}"
        for name, key in [("torch", "torch"), ("triton", "triton"), ("fla-core", "fla"), ("Python", "python")]
        if env.get(key)
    )
    commit = f"`{(env.get('commit') or 'unknown')[:12]}`"
    if env.get("commit_dirty"):
        commit += " with uncommitted changes to tracked files"
    ok = sum(s["summary"]["completed"] for c in record["cells"] for s in c["streams"] if s.get("summary"))
    failed = sum(s["summary"]["failed"] for c in record["cells"] for s in c["streams"] if s.get("summary"))
    rows = [
        ("GPU", gpu),
        ("software", software or "unknown"),
        *([("Python bytecode", bytecode)] if (bytecode := _bytecode(env)) else []),
        ("commit", commit),
        (
            "model",
            f"{record['model']} (`make-tiny --preset {record['preset']}`), random weights (`--load-format dummy`)",
        ),
        ("server flags", f"`{' '.join(server['flags'])}`"),
        ("DELTASERVE_ variables", f"`{_variables(env)}`" if env.get("variables") else "none"),
        ("server start -> HTTP ready", _seconds(server.get("ready_s"))),
        ("group wall time", f"{_seconds(record.get('wall_s'))} (expected ~{record['expected_wall_s']} s)"),
    ]
    if server.get("graphs_ahead_s") is not None:
        rows.insert(
            -1,
            (
                "server start -> idle-time graph captures done (the cells start after)",
                _seconds(server["graphs_ahead_s"]),
            ),
        )
    if not record["startup_group"]:
        rows.append(("completed / failed", f"{ok} / {failed} (all cells)"))
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _results_section(record: dict[str, Any]) -> list[str]:
    date = record.get("previous_record_date", "")
    lines = [
        "## Results",
        "",
        "Latencies in ms as mean / median / p99 / max. Floors and the previous record are those of "
        f"`deltaserve/bench/records.py` (H200 floors; the {date} H200 record over HTTP).",
        "",
        f"| cell | completed / failed | TTFT | TPOT | ITL | out tok/s | total tok/s | floor | previous record ({date}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in record["cells"]:
        for stream in cell["streams"]:
            title = _stream_title(cell, stream)
            if not stream.get("summary"):
                lines.append(
                    f"| {title} | **failed: {_cell_text(stream.get('error') or 'no result')}** "
                    f"| | | | | | {_floor(cell, None)} | {_previous(cell)} |"
                )
                continue
            s = StreamSummary.from_record(stream["summary"])
            lines.append(
                f"| {title} | {s.completed} / {s.failed} | {_spread(s.ttft_ms)} | {_spread(s.tpot_ms)} "
                f"| {_spread(s.itl_ms)} | {_rate(s.output_tok_s)} | {_rate(s.total_tok_s)} "
                f"| {_floor(cell, s)} | {_previous(cell)} |"
            )
    notes = [f"- {c['title']}: {c['note']}" for c in record["cells"] if c.get("note")]
    return [
        *lines,
        "",
        *notes,
        *([""] if notes else []),
        *_worst_gap_section(record),
        *_host_cpu_section(record),
        *_gpu_clocks_section(record),
    ]


def _stream_title(cell: dict[str, Any], stream: dict[str, Any]) -> str:
    """A stream's row title: the cell's, with the stream's name where the cell runs several."""
    return cell["title"] + (f": **{stream['name']}**" if stream["name"] else "")


def _worst_gap_section(record: dict[str, Any]) -> list[str]:
    """Where each stream's ITL max happened, and how many other streams it stalled."""
    rows = []
    for cell in record["cells"]:
        for stream in cell["streams"]:
            gap = (stream.get("summary") or {}).get("worst_itl_gap")
            if not gap:
                continue
            title = _stream_title(cell, stream)
            preemptions = cell.get("preemptions")
            rows.append(
                f"| {title} | {_ms(gap['ms'])} | {gap['request']} | {gap['token']} | {gap['at_s']:.2f} s "
                f"| {gap['streams_stalled']} of {gap['streams_active']} "
                f"| {'—' if preemptions is None else preemptions} |"
            )
    if not rows:
        return []
    return [
        "## The worst inter-token gap of each run",
        "",
        "The request (in send order) and chunk that ended the ITL max, when in the run, and how many of the "
        "other streams active across it got no chunk meanwhile: all of them is a stall of a whole process "
        "(client, API server or engine), none is that request's own (its prefill, or a preemption: the "
        "server's count of recompute preemptions over the cell is beside it).",
        "",
        "| cell | ms | request | chunk | at | streams stalled | preemptions in the cell |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _host_cpu_section(record: dict[str, Any]) -> list[str]:
    """CPU time of the server and its children over each cell's measured run (where /proc told)."""
    rows = []
    for cell in record["cells"]:
        cpu = cell.get("host_cpu")
        if not cpu:
            continue
        summaries = [StreamSummary.from_record(st["summary"]) for st in cell["streams"] if st.get("summary")]
        tokens = sum(x.output_tok_s * x.duration_s for x in summaries)
        per_token = f"{cpu['server_s'] * 1e6 / tokens:.0f}" if tokens > 0 else "—"
        rows.append(
            f"| {cell['title']} | {cpu['wall_s']:.1f} s | {cpu['server_s']:.2f} s "
            f"({100 * cpu['server_s'] / cpu['wall_s']:.0f}%) | {cpu['engine_s']:.2f} s "
            f"({100 * cpu['engine_s'] / cpu['wall_s']:.0f}%) | {per_token} |"
        )
    if not rows:
        return []
    return [
        "## Host CPU over each measured run",
        "",
        "CPU seconds (user + system, from /proc) of the API server process and of its child processes "
        "(the engine, and the grammar worker when one runs), against the run's wall time. 100% is one "
        "core; the server's event loop runs on one.",
        "",
        "| cell | wall | API server | child processes | server µs per output token |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def _gpu_clocks_section(record: dict[str, Any]) -> list[str]:
    """The SM clock and power of each cell's measured run (where nvidia-smi sampled them)."""
    rows = []
    for cell in record["cells"]:
        gpu = cell.get("gpu_clocks")
        if not gpu:
            continue
        of_max = f" of {gpu['sm_mhz_max']:.0f}" if gpu["sm_mhz_max"] else ""
        power = "—" if gpu["power_w_median"] is None else f"{gpu['power_w_median']:.0f} W"
        if gpu["power_w_median"] is not None and gpu["power_limit_w"]:
            power += f" of {gpu['power_limit_w']:.0f} W"
        rows.append(
            f"| {cell['title']} | {gpu['busy_samples']} of {gpu['samples']} | {gpu['sm_mhz_median']:.0f}{of_max} MHz "
            f"| {power} | {100 * gpu['power_capped_share']:.0f}% | {100 * gpu['thermal_share']:.0f}% |"
        )
    if not rows:
        return []
    return [
        "## GPU clocks over each measured run",
        "",
        f"`nvidia-smi` every {gpu_clocks.SAMPLE_MS / 1000:g} s beside the run, over the samples with the GPU at "
        f"least {gpu_clocks.BUSY_UTILIZATION}% busy: the SM "
        "clock's median against its maximum, the power drawn against the limit, and the share of samples the "
        "driver throttled for power (software power cap) or heat. A power-capped run's steps are slower "
        "than `bench forward`'s short bursts at the full clock.",
        "",
        "| cell | busy samples | SM clock, median | power, median | power-capped | thermal |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _startup_section(record: dict[str, Any]) -> list[str]:
    lines = [
        "## Start-up",
        "",
        "| start | process start -> HTTP ready | -> first 1-token completion returned | SIGTERM -> exit "
        f"| previous record ({record.get('previous_record_date', '')}) |",
        "|---|---|---|---|---|",
    ]
    for cell in record["cells"]:
        start = cell.get("startup") or {}
        if start.get("error"):
            lines.append(
                f"| {cell['title']} | **failed: {_cell_text(start['error'])}** | | | {_previous(cell)} |"
            )
            continue
        lines.append(
            f"| {cell['title']} | {_seconds(start.get('ready_s'))} | {_seconds(start.get('first_response_s'))} "
            f"| {_seconds(start.get('stop_s'))} | {_previous(cell)} |"
        )
    return [*lines, ""]


def _turn_sections(record: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for cell in record["cells"]:
        for stream in cell["streams"]:
            turns = (stream.get("summary") or {}).get("per_turn") or []
            if not turns:
                continue
            lines += [
                f"## Per turn: {cell['title']}",
                "",
                "| turn | completed / failed | TTFT mean / median / p99 (ms) | prompt tokens (mean) | cached-token share |",
                "|---|---|---|---|---|",
            ]
            for t in turns:
                ttft = f"{_ms(t['mean_ttft_ms'])} / {_ms(t['median_ttft_ms'])} / {_ms(t['p99_ttft_ms'])}"
                lines.append(
                    f"| {t['turn']} | {t['completed']} / {t['failed']} | {ttft} | {t['mean_prompt_tokens']:.0f} "
                    f"| {format_share(t['cached_token_share'])} |"
                )
            share = stream["summary"].get("cached_token_share")
            lines += ["", f"Cached-token share over the whole run: {format_share(share)}.", ""]
    return lines


def _variables(env: dict[str, Any]) -> str:
    """The run's DELTASERVE_* variables as a shell prefix (`A=1 B=2`), or ''."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in (env.get("variables") or {}).items())


def _reproduce_section(record: dict[str, Any]) -> list[str]:
    prefix = _variables(record["environment"])
    lines = [
        "## Reproduce",
        "",
        "```bash",
        f"{prefix} {record['command']}" if prefix else record["command"],
        "```",
        "",
        "It runs, in order (`$MODEL_DIR`: the shape config make-tiny writes; `$RAW`: the raw results "
        "directory; the server on port 8000 here, on a free port in the run):",
        "",
        "```bash",
        record["make_tiny_command"],
        (f"{prefix} " if prefix else "") + record["server"]["command"] + " &",
    ]
    for cell in record["cells"]:
        for stream in cell["streams"]:
            lines += [
                f"# {cell['name']}{' ' + stream['name'] if stream['name'] else ''}: warm-up, then timed"
            ]
            lines += [
                stream["warmup_command"],
                stream["command"] + (" &" if len(cell["streams"]) > 1 else ""),
            ]
    lines += ["```", "", f"Raw results and logs: `{record['raw_dir']}/`."]
    return lines


def _floor(cell: dict[str, Any], summary: StreamSummary | None) -> str:
    parts = []
    for figure in cell.get("floor") or []:
        text = figure["text"]
        if summary is not None and figure.get("metric") and figure["value"]:
            text += f" (measured {summary.value(figure['metric']) / figure['value']:.2f}x)"
        parts.append(text)
    return "; ".join(parts) or "—"


def _previous(cell: dict[str, Any]) -> str:
    return "; ".join(f["text"] for f in cell.get("previous") or []) or "—"


def _spread(s: Spread) -> str:
    """ "—" for an empty sample (bench serve reports 0, as vLLM does): TPOT and ITL of 1-token outputs."""
    if s.max == 0:
        return "—"
    return f"{_ms(s.mean)} / {_ms(s.median)} / {_ms(s.p99)} / {_ms(s.max)}"


def _ms(value: float) -> str:
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _rate(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


def _cell_text(text: str) -> str:
    """One line, no table separators."""
    return " ".join(text.split()).replace("|", "/")[:300]
