"""`deltaserve bench matrix`: the plan of each group, record names, the markdown written from a record,
and CPU runs of the hidden smoke groups against the real tiny server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from deltaserve.bench.matrix import (
    Plan,
    _failure_text,
    _plan,
    add_bench_matrix_arguments,
    command_text,
    initial_record,
    record_ok,
    record_stem,
    unique_stem,
)
from deltaserve.bench.matrix_env import engine_variables, gpu_slug, probe_environment
from deltaserve.bench.matrix_plan import GROUPS, Stream, select_cells
from deltaserve.bench.matrix_report import StreamSummary, render_markdown, summary_json, tensor_parallel_size
from deltaserve.bench.matrix_server import ServerProcess, read_counter
from deltaserve.bench.records import REFERENCES
from deltaserve.cli import main

STANDARD_GROUPS = [
    "decode-4b",
    "prefill-4b",
    "mixed-4b",
    "multiturn-4b",
    "sampling-4b",
    "saturated-9b",
    "saturated-35b",
    "decode-27b",
    "decode-35b",
    "startup-4b",
]


def _flag(flags: tuple[str, ...], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def _shape(stream: Stream) -> tuple[int, int, int | None, int]:
    """(input len, output len, max concurrency, prompts) of a random-dataset stream."""
    f = stream.flags
    concurrency = _flag(f, "--max-concurrency")
    return (
        int(_flag(f, "--random-input-len")),
        int(_flag(f, "--random-output-len")),
        int(concurrency) if concurrency else None,
        int(_flag(f, "--num-prompts")),
    )


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_matrix_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_public_groups_are_the_standard_matrix_and_each_fits_in_ten_minutes():
    assert [name for name, g in GROUPS.items() if g.public] == STANDARD_GROUPS
    for group in GROUPS.values():
        assert 0 < group.expected_wall_s < 600, group.name
        names = [c.name for c in group.cells]
        assert len(names) == len(set(names)), group.name
        assert group.startup == (not any(c.streams for c in group.cells)), group.name


def test_decode_4b_runs_the_standard_decode_cells_with_ignore_eos():
    cells = GROUPS["decode-4b"].cells
    assert [_shape(c.streams[0]) for c in cells] == [
        (1, 256, 1, 20),
        (1, 1, 1, 50),
        (1024, 256, 1, 10),
        (1024, 256, 16, 64),
        (1024, 256, 64, 256),
        (128, 512, 256, 512),
    ]
    assert all("--ignore-eos" in c.streams[0].flags for c in cells)
    assert GROUPS["decode-4b"].preset == "4b-shape" and GROUPS["decode-4b"].server_flags == ()


def test_sampling_4b_runs_greedy_the_cards_sampling_and_a_constrained_stream_beside_free_ones():
    cells = GROUPS["sampling-4b"].cells
    assert [_shape(c.streams[0]) for c in cells] == [
        (1, 2048, 1, 4),
        (1, 2048, 1, 4),
        (1024, 2048, 64, 128),
        (1024, 512, 64, 128),
        (1024, 512, 60, 120),
    ]
    assert _flag(cells[0].streams[0].flags, "--presence-penalty") is None
    for cell in cells[1:3]:
        for flags in (cell.streams[0].flags, cell.streams[0].warmup_flags):
            assert _flag(flags, "--presence-penalty") == "1.5" and _flag(flags, "--top-k") == "20"
    free, regex = cells[4].streams
    assert _shape(regex) == (1024, 512, 4, 8) and _flag(free.flags, "--extra-body") is None
    body = json.loads(_flag(regex.flags, "--extra-body"))
    assert body == {"structured_outputs": {"regex": "([a-z]+ )+"}}


def test_prefill_4b_measures_8k_32k_128k_prompts_within_its_context_window():
    group = GROUPS["prefill-4b"]
    assert [_shape(c.streams[0])[:3] for c in group.cells] == [(8192, 1, 1), (32768, 1, 1), (131072, 1, 1)]
    assert int(_flag(group.server_flags, "--max-model-len")) >= 131072 + 1


def test_saturated_cells_are_the_published_cell_with_default_flags():
    for name, preset in [("saturated-9b", "9b-shape"), ("saturated-35b", "35b-a3b-shape")]:
        group = GROUPS[name]
        (cell,) = group.cells
        assert group.preset == preset and group.server_flags == ()
        assert _shape(cell.streams[0]) == (1024, 128, 512, 1000)
        assert _flag(cell.streams[0].flags, "--request-rate") == "inf"


def test_mixed_4b_runs_four_decoders_beside_cold_prefills_at_half_a_qps_for_60_s():
    (cell,) = GROUPS["mixed-4b"].cells
    decoders, prefills = cell.streams
    assert (decoders.name, prefills.name) == ("decoders", "prefills")
    assert _shape(decoders)[:3] == (512, 4000, 4)
    assert _shape(prefills) == (8192, 1, None, 30) and _flag(prefills.flags, "--request-rate") == "0.5"
    # 30 prompts at 0.5 QPS: the last one is sent 60 s after the first.
    assert _flag(decoders.flags, "--seed") != _flag(prefills.flags, "--seed")  # cold: no shared prompt start


def test_multiturn_4b_is_the_standard_workload():
    (cell,) = GROUPS["multiturn-4b"].cells
    f = cell.streams[0].flags
    assert _flag(f, "--dataset-name") == "multi-turn"
    assert [_flag(f, n) for n in ["--num-prompts", "--max-concurrency", "--multi-turn-num-turns"]] == [
        "32",
        "32",
        "10",
    ]
    assert [_flag(f, n) for n in ["--multi-turn-system-prompt-len", "--multi-turn-user-len"]] == [
        "2000",
        "200",
    ]


def test_warmups_run_at_each_cells_prompt_length_with_another_seed():
    for group in GROUPS.values():
        for cell in group.cells:
            for stream in cell.streams:
                timed, warm = stream.flags, stream.warmup_flags
                assert _flag(warm, "--seed") != _flag(timed, "--seed"), cell.name
                for length in [
                    "--random-input-len",
                    "--multi-turn-system-prompt-len",
                    "--multi-turn-user-len",
                ]:
                    assert _flag(warm, length) == _flag(timed, length), (cell.name, length)
                assert int(_flag(warm, "--num-prompts")) <= min(256, int(_flag(timed, "--num-prompts")))
                assert "--save-result" not in warm


def test_cells_selects_a_subset_in_group_order_and_names_the_choices_on_error():
    group = select_cells(GROUPS["decode-4b"], "1024-256-c16,1-256-c1")
    assert [c.name for c in group.cells] == ["1-256-c1", "1024-256-c16"]
    with pytest.raises(ValueError, match="has cells 1-256-c1, 1-1-c1"):
        select_cells(GROUPS["decode-4b"], "1-256-c2")


def test_record_names_are_date_gpu_group_and_never_overwrite(tmp_path):
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu_slug(None) == "cpu"
    assert record_stem("2026-12-05", "h200", "decode-4b") == "2026-12-05-h200-decode-4b"
    assert (
        record_stem("2026-12-05", "h200", "decode-4b", "no-prefix-cache")
        == "2026-12-05-h200-decode-4b-no-prefix-cache"
    )
    assert unique_stem(tmp_path, "2026-12-05-h200-decode-4b") == "2026-12-05-h200-decode-4b"
    (tmp_path / "2026-12-05-h200-decode-4b.md").write_text("")
    (tmp_path / "2026-12-05-h200-decode-4b-2").mkdir()
    assert unique_stem(tmp_path, "2026-12-05-h200-decode-4b") == "2026-12-05-h200-decode-4b-3"


def test_server_args_come_after_the_group_flags_so_they_win(tmp_path):
    args = _args(
        "--group", "prefill-4b", "--out", str(tmp_path), "--server-args", "--max-num-batched-tokens 4096"
    )
    plan = _plan(args, GROUPS["prefill-4b"], "2026-12-05", "h200")
    argv = plan.serve_argv(8000)
    assert argv[argv.index("serve") :][:5] == ["serve", "--model", str(plan.model_dir), "--port", "8000"]
    assert argv[-6:] == [
        "--max-model-len",
        "132096",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-batched-tokens",
        "4096",
    ]
    assert "--load-format dummy --served-model-name 4b-shape" in " ".join(argv)
    assert plan.matrix_command() == (
        "python3 -m deltaserve.cli bench matrix --group prefill-4b '--server-args=--max-num-batched-tokens 4096'"
    )


def test_dry_run_prints_the_commands_in_order_and_starts_nothing(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["bench", "matrix", "--group", "mixed-4b", "--dry-run", "--out", str(out), "--work-dir", str(work)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()

    commands = [line for line in lines if not line.startswith("#")]
    assert commands[0].endswith(f"make-tiny {work / '4b-shape'} --preset 4b-shape --config-only")
    assert " serve --model " in commands[1] and "--port $PORT --load-format dummy" in commands[1]
    warm_decoders, warm_prefills, decoders, prefills = commands[2:6]
    assert "--seed 1000" in warm_decoders and "--seed 1001" in warm_prefills
    assert "--random-output-len 4000" in decoders and "--result-filename mixed-decoders.json" in decoders
    assert "--request-rate 0.5" in prefills and "--result-filename mixed-prefills.json" in prefills
    assert all("--base-url http://127.0.0.1:$PORT" in c for c in commands[2:6])
    assert len(commands) == 6
    assert any(f"{out}/" in line and "-mixed-4b.md" in line for line in lines)
    assert not out.exists() and not work.exists()  # nothing written, nothing started


def _bench_json(completed: int, failed: int, **overrides: Any) -> dict[str, Any]:
    """A `bench serve` result: TTFT 12/11.5/15/16 ms, TPOT 3.1/3.05/3.4/3.9, ITL 3.1/3.0/4.5/20,
    E2EL 800/790/850/900 (mean/median/p99/max)."""
    data: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "duration": 16.5,
        "output_throughput": 310.3,
        "total_token_throughput": 311.5,
        "max_concurrent_requests": 1,
        "cached_token_share": None,
    }
    for metric, values in {
        "ttft": (12.0, 11.5, 15.0, 16.0),
        "tpot": (3.1, 3.05, 3.4, 3.9),
        "itl": (3.1, 3.0, 4.5, 20.0),
        "e2el": (800.0, 790.0, 850.0, 900.0),
    }.items():
        for stat, value in zip(["mean", "median", "p99", "p100"], values, strict=True):
            data[f"{stat}_{metric}_ms"] = value
    return data | overrides


ENV = {
    "gpu": "NVIDIA H200",
    "gpu_memory_mib": 143771,
    "gpu_count": 1,
    "driver": "580.159.04",
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "fla": "0.6.0",
    "python": "3.12.3",
    "commit": "0123456789abcdef0123",
    "commit_dirty": False,
}


def _record(tmp_path: Path, group: str, cells: str | None = None) -> tuple[Plan, dict[str, Any]]:
    args = _args("--group", group, "--out", str(tmp_path), *(["--cells", cells] if cells else []))
    plan = _plan(args, select_cells(GROUPS[group], cells), "2026-12-05", "h200")
    return plan, initial_record(plan, ENV, "2026-12-05")


def test_markdown_puts_the_floor_and_previous_record_beside_each_number(tmp_path):
    plan, record = _record(tmp_path, "decode-4b", "1-256-c1,1024-256-c64")
    record["server"]["ready_s"] = 31.24
    record["wall_s"] = 182.0
    fast, loaded = record["cells"]
    fast["streams"][0]["summary"] = summary_json(StreamSummary.from_bench_json(_bench_json(20, 0)))
    prefill = _bench_json(3, 0) | {
        f"{s}_{m}_ms": 0.0 for s in ["mean", "median", "p99", "p100"] for m in ["tpot", "itl"]
    }
    prefill_row = render_markdown(_one_cell(plan, "prefill-4b", "8192-1-c1", prefill))
    assert "| 4B, 8192 in / 1 out, concurrency 1 | 3 / 0 | 12.0 / 11.5 / 15.0 / 16.0 | — | — |" in prefill_row
    loaded["streams"][0]["error"] = "bench serve exited with 1; see 1024-256-c64.log: HTTP 500"
    md = render_markdown(json.loads(json.dumps(record))).splitlines()

    assert md[0] == "# 2026-12-05 NVIDIA H200: decode-4b"
    assert "| GPU | NVIDIA H200 (143771 MiB), driver 580.159.04 |" in md
    assert "| software | torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0, Python 3.12.3 |" in md
    assert "| commit | `0123456789ab` |" in md
    assert "| server flags | `--load-format dummy --served-model-name 4b-shape` |" in md
    assert "| server start -> HTTP ready | 31.2 s |" in md
    assert "| DELTASERVE_ variables | none |" in md
    assert "| completed / failed | 20 / 0 (all cells) |" in md
    # Median TPOT 3.05 ms against the 1.95 ms floor: 1.56x.
    assert (
        "| 4B, 1 in / 256 out, concurrency 1 | 20 / 0 | 12.0 / 11.5 / 15.0 / 16.0 | 3.10 / 3.05 / 3.40 / 3.90 "
        "| 3.10 / 3.00 / 4.50 / 20.0 | 310 | 312 | TPOT ~1.95 ms (measured 1.56x) | TPOT 2.78 ms |"
    ) in md
    assert (
        "| 4B, 1024 in / 256 out, concurrency 64 | **failed: bench serve exited with 1; see 1024-256-c64.log: "
        "HTTP 500** | | | | | | — | output 6.31k tok/s; TPOT 9.35 ms; ITL p99 36.2 ms |"
    ) in md
    assert "python3 -m deltaserve.cli bench matrix --group decode-4b --cells 1-256-c1,1024-256-c64" in md
    assert "python3 -m deltaserve.cli make-tiny $MODEL_DIR --preset 4b-shape --config-only" in md
    assert any(
        line.startswith("python3 -m deltaserve.bench.serve ") and "--result-dir $RAW" in line for line in md
    )
    assert not record_ok(record)


def test_a_records_deltaserve_variables_are_stated_and_prefix_its_commands(tmp_path):
    """An A/B through a DELTASERVE_* switch: the record says which side it is, and its commands rerun it."""
    assert engine_variables(
        {"DELTASERVE_FUSED_GEMV": "1", "DELTASERVE_CACHE_DIR": "/x", "PATH": "/bin", "DELTASERVE_A": "x y"}
    ) == {"DELTASERVE_A": "x y", "DELTASERVE_FUSED_GEMV": "1"}
    _, record = _record(tmp_path, "decode-4b", "1-256-c1")
    record["environment"] = ENV | {"variables": {"DELTASERVE_FUSED_GEMV": "1"}}
    md = render_markdown(json.loads(json.dumps(record))).splitlines()
    assert "| DELTASERVE_ variables | `DELTASERVE_FUSED_GEMV=1` |" in md
    assert (
        "DELTASERVE_FUSED_GEMV=1 python3 -m deltaserve.cli bench matrix --group decode-4b --cells 1-256-c1"
        in md
    )
    assert any(line.startswith("DELTASERVE_FUSED_GEMV=1 python3 -m deltaserve.cli serve ") for line in md)


def test_the_header_says_how_many_of_the_visible_gpus_the_server_uses(tmp_path):
    assert tensor_parallel_size(["--load-format", "dummy"]) == 1
    assert tensor_parallel_size(["--tensor-parallel-size", "2", "--max-num-seqs", "8"]) == 2
    assert tensor_parallel_size(["--tensor-parallel-size=4"]) == 4
    assert tensor_parallel_size(["-tp", "2"]) == 2
    _, record = _record(tmp_path, "decode-27b", "1024-256-c1")
    record["environment"] = ENV | {"gpu_count": 2}
    record["server"]["flags"] = [*record["server"]["flags"], "--tensor-parallel-size", "2"]
    assert "2 visible (the server uses 2)" in render_markdown(json.loads(json.dumps(record)))
    record["server"]["flags"] = record["server"]["flags"][:-2]
    assert "2 visible (the server uses one)" in render_markdown(json.loads(json.dumps(record)))


def test_the_header_says_whether_imports_compile_from_source(tmp_path):
    _, record = _record(tmp_path, "startup-4b")

    def bytecode_row(compiled: int | None, writes: bool) -> str | None:
        record["environment"] = ENV | (
            {} if compiled is None else {"torch_modules": 2400, "torch_modules_compiled": compiled}
        )
        record["environment"]["writes_bytecode"] = writes
        rows = render_markdown(json.loads(json.dumps(record))).splitlines()
        return next((row for row in rows if row.startswith("| Python bytecode |")), None)

    assert bytecode_row(0, False) == (
        "| Python bytecode | torch's modules byte-compiled: 0 of 2,400; the interpreter writes none (imports "
        "compile from source: start-up times are not an installed environment's) |"
    )
    assert bytecode_row(2400, True) == (
        "| Python bytecode | torch's modules byte-compiled: 2,400 of 2,400; the interpreter writes bytecode |"
    )
    assert bytecode_row(None, True) is None


def test_the_environment_probe_counts_torchs_byte_compiled_modules():
    env = probe_environment()
    assert env["torch_modules"] > 100 and 0 <= env["torch_modules_compiled"] <= env["torch_modules"], env
    assert env["writes_bytecode"] is (not sys.flags.dont_write_bytecode)


def _one_cell(plan: Plan, group: str, cell: str, bench_json: dict[str, Any]) -> dict[str, Any]:
    """A record of one cell of `group` with `bench_json` as its result."""
    _, record = _record(plan.out_dir, group, cell)
    record["cells"][0]["streams"][0]["summary"] = summary_json(StreamSummary.from_bench_json(bench_json))
    return record


def test_markdown_says_where_each_runs_worst_gap_happened(tmp_path):
    plan, _ = _record(tmp_path, "decode-4b", "1024-256-c64")
    gap = {"ms": 92.1, "request": 17, "token": 1, "at_s": 0.84, "streams_stalled": 63, "streams_active": 63}
    md = render_markdown(
        _one_cell(plan, "decode-4b", "1024-256-c64", _bench_json(20, 0) | {"worst_itl_gap": gap})
    )
    assert "| 4B, 1024 in / 256 out, concurrency 64 | 92.1 | 17 | 1 | 0.84 s | 63 of 63 |" in md
    assert "| 63 of 63 | — |" in md  # a record without the server's counter
    record = _one_cell(plan, "decode-4b", "1024-256-c64", _bench_json(20, 0) | {"worst_itl_gap": gap})
    record["cells"][0]["preemptions"] = 12
    assert "| 0.84 s | 63 of 63 | 12 |" in render_markdown(record)
    assert "worst inter-token gap" not in render_markdown(
        _one_cell(plan, "decode-4b", "1024-256-c64", _bench_json(20, 0))
    )


def test_markdown_of_a_multi_turn_cell_has_the_per_turn_table(tmp_path):
    _, record = _record(tmp_path, "multiturn-4b")
    turns = [
        {"turn": 1, "completed": 32, "failed": 0, "mean_ttft_ms": 410.0, "median_ttft_ms": 400.0,
         "p99_ttft_ms": 650.0, "mean_prompt_tokens": 2212.0, "cached_token_share": 0.0},
        {"turn": 2, "completed": 32, "failed": 0, "mean_ttft_ms": 95.5, "median_ttft_ms": 90.0,
         "p99_ttft_ms": 130.0, "mean_prompt_tokens": 2549.0, "cached_token_share": 0.8625},
    ]  # fmt: skip
    result = _bench_json(64, 0, cached_token_share=0.5, per_turn=turns)
    record["cells"][0]["streams"][0]["summary"] = summary_json(StreamSummary.from_bench_json(result))
    md = render_markdown(json.loads(json.dumps(record))).splitlines()

    assert "## Per turn: " + record["cells"][0]["title"] in md
    assert "| 1 | 32 / 0 | 410.0 / 400.0 / 650.0 | 2212 | 0.00% |" in md
    assert "| 2 | 32 / 0 | 95.5 / 90.0 / 130.0 | 2549 | 86.25% |" in md
    assert "Cached-token share over the whole run: 50.00%." in md
    assert record_ok(record)


def test_markdown_of_the_startup_group_lists_each_start(tmp_path):
    _, record = _record(tmp_path, "startup-4b")
    record["cells"][0]["startup"] = {"ready_s": 27.04, "first_response_s": 66.5, "stop_s": 2.25, "error": ""}
    record["cells"][1]["startup"] = {
        "ready_s": None,
        "first_response_s": None,
        "stop_s": 0.1,
        "error": "exited",
    }
    md = render_markdown(record).splitlines()
    title = record["cells"][0]["title"]
    assert f"| {title} | 27.0 s | 66.5 s | 2.2 s | HTTP ready 18.3 s |" in md
    assert f"| {record['cells'][1]['title']} | **failed: exited** | | | HTTP ready 7.5 s |" in md
    assert not record_ok(record)


def test_every_reference_names_a_cell_and_every_floor_metric_reads_from_a_summary():
    cells = {f"{g.preset}:{c.name}" for g in GROUPS.values() for c in g.cells}
    summary = StreamSummary.from_bench_json(_bench_json(1, 0))
    for key, ref in REFERENCES.items():
        assert key in cells, key
        for figure in ref.floor:
            assert figure.metric is None or summary.value(figure.metric) > 0, (key, figure)


def test_command_text_leaves_placeholders_for_the_shell():
    assert command_text(["serve", "--model", "$MODEL_DIR", "--server-args", "--a 1"]) == (
        "serve --model $MODEL_DIR --server-args '--a 1'"
    )


def _read_record(out: Path, group: str) -> tuple[dict[str, Any], Path]:
    (path,) = out.glob(f"*-cpu-{group}.json")
    return json.loads(path.read_text()), path


@pytest.mark.slow
def test_smoke_group_runs_server_and_cells_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "matrix", "--group", "smoke-tiny", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    assert main(argv) == 0

    record, path = _read_record(out, "smoke-tiny")
    assert record["error"] == "" and record["server"]["ready_s"] > 0 and record["server"]["stop_s"] >= 0
    streams = {(c["name"], s["name"]): s for c in record["cells"] for s in c["streams"]}
    assert list(streams) == [
        ("8-4-c2", ""),
        ("mixed", "decoders"),
        ("mixed", "prefills"),
        ("multi-turn-c2", ""),
    ]
    for stream in streams.values():
        assert (
            stream["error"] == "" and stream["summary"]["failed"] == 0 and stream["summary"]["completed"] > 0
        )
    assert streams[("8-4-c2", "")]["summary"]["completed"] == 4
    assert [t["turn"] for t in streams[("multi-turn-c2", "")]["summary"]["per_turn"]] == [1, 2]
    raw = out / record["raw_dir"]
    assert {"server.log", "8-4-c2.json", "mixed-decoders.json", "mixed-prefills.json"} <= {
        p.name for p in raw.iterdir()
    }
    md = path.with_suffix(".md").read_text()
    assert "| tiny, 8 in / 4 out, concurrency 2 | 4 / 0 |" in md and "## Per turn: " in md
    # Host CPU over each measured run: the server streamed the tokens, the engine computed them. /proc
    # counts CPU time in clock ticks (10 ms): one short cell's server time is 0 or 1 tick, so the server's
    # is asserted over the group's cells (2-5 ticks measured).
    cpus = [c["host_cpu"] for c in record["cells"]]
    assert all(c["wall_s"] > 0 and c["server_s"] >= 0 and c["engine_s"] > 0 for c in cpus), cpus
    assert sum(c["server_s"] for c in cpus) > 0, cpus
    assert "## Host CPU over each measured run" in md


@pytest.mark.slow
def test_startup_smoke_times_http_ready_and_the_first_completion_on_cpu(tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "matrix", "--group", "smoke-startup-tiny", "--cells", "first-start", "--out", str(out)]
    assert main([*argv, "--work-dir", str(tmp_path / "w")]) == 0

    record, _ = _read_record(out, "smoke-startup-tiny")
    (cell,) = record["cells"]
    start = cell["startup"]
    assert start["error"] == "" and 0 < start["ready_s"] <= start["first_response_s"] and start["stop_s"] >= 0


@pytest.mark.slow
def test_a_server_that_cannot_start_fails_the_run_with_its_log_in_the_record(tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "matrix", "--group", "smoke-tiny", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    assert main([*argv, "--server-args=--no-such-flag"]) == 1

    record, path = _read_record(out, "smoke-tiny")
    assert record["error"].startswith("ServerError: the server exited with 2 during start-up")
    assert "--no-such-flag" in record["error"]  # the tail of the server's log names the bad flag
    assert all(s["summary"] is None for c in record["cells"] for s in c["streams"])
    assert "**The run did not finish:**" in path.with_suffix(".md").read_text()


def test_a_failed_run_is_explained_by_its_first_request_error_and_the_servers_errors(tmp_path):
    log = tmp_path / "cell.log"
    log.write_text(
        "Failed requests during benchmark run detected (capping to 10):\n"
        "Error 0: HTTP 500: engine step failed: CUDA out of memory\n"
        "Error 1: HTTP 500: engine step failed: CUDA out of memory\n"
        "============ Serving Benchmark Result ============\nSuccessful requests: 0\nP99 E2EL (ms): 0.0\n"
    )
    assert _failure_text(log) == "Error 0: HTTP 500: engine step failed: CUDA out of memory"
    log.write_text("one\ntwo\nthree\nfour\nfive\nsix\n")  # no request errors: the last five lines
    assert _failure_text(log) == "two | three | four | five | six"
    assert _failure_text(tmp_path / "missing.log") == "(no log)"

    server_log = tmp_path / "server.log"
    server_log.write_text("2026-12-03 08:00:00,000 engine ERROR before the cell\n")
    server = ServerProcess(proc=None, url="", log_path=server_log, started_at=0.0)
    offset = server.log_size()
    with open(server_log, "a") as f:
        f.write("2026-12-03 08:00:01,000 engine INFO step\n")
        f.write("2026-12-03 08:00:02,000 engine ERROR step failed: CUDA out of memory\n")
        f.write("2026-12-03 08:00:03,000 deltaserve.server CRITICAL engine died\n")
        f.write("ERRORS in a message are not a level\n")
    assert server.errors_since(offset) == [
        "2026-12-03 08:00:02,000 engine ERROR step failed: CUDA out of memory",
        "2026-12-03 08:00:03,000 deltaserve.server CRITICAL engine died",
    ]
    assert server.errors_since(0, limit=1) == ["2026-12-03 08:00:00,000 engine ERROR before the cell"]


def test_the_preemptions_of_a_cell_are_read_from_the_servers_metrics():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from deltaserve.bench.matrix import counter_change
    from deltaserve.engine.protocol import LoadSnapshot
    from deltaserve.server.metrics import ServerMetrics

    loads = iter([LoadSnapshot(num_preemptions=5), LoadSnapshot(num_preemptions=17)])
    metrics = ServerMetrics("m", lambda: next(loads))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics.render() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = ServerProcess(
            proc=None, url=f"http://127.0.0.1:{httpd.server_port}", log_path=Path("x"), started_at=0
        )
        before = read_counter(server, "vllm:num_preemptions")
        after = read_counter(server, "vllm:num_preemptions")
        assert (before, after) == (5.0, 17.0)
        assert counter_change(before, after) == 12
        assert read_counter(server, "vllm:no_such_counter") is None
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert read_counter(server, "vllm:num_preemptions", timeout_s=1) is None  # nobody answers
    assert counter_change(None, 3.0) is None
