"""`bench steps` (server step-log summary, hand-computed) and `bench forward` (shape parsing; one CPU run)."""

from __future__ import annotations

import argparse

import pytest

from deltaserve.bench.forward_cost import RowGroup, parse_shape, run_bench_forward, shape_rows
from deltaserve.bench.step_log import (
    DeviceTime,
    TimeShare,
    device_time,
    intervals,
    parse_steps,
    run_bench_steps,
    runs,
    split_run,
    summarize,
    write_report,
)
from deltaserve.engine.core import EngineCore
from deltaserve.engine_config import EngineConfig


def line(
    end_ms: float, kind: str, tokens: int, reqs: int, rows: int, step_ms: float, phases: str = ""
) -> str:
    return (
        f"2026-12-01 12:00:00,000 engine INFO ITL_STEP mono_us={int(end_ms * 1000)} kind={kind} "
        f"prefill_tokens={tokens} prefill_reqs={reqs} decode_rows={rows} step_us={int(step_ms * 1000)}"
        + (f" phases_us={phases}" if phases else "")
    )


LOG = [
    line(1000.0, "prefill", 2048, 1, 0, 40.0),  # no decode rows: a previous step only
    "2026-12-01 12:00:00,001 deltaserve.server INFO an unrelated line",
    line(1006.0, "decode_ahead", 0, 0, 8, 5.5),
    line(1012.0, "decode_ahead", 0, 0, 8, 5.5),
    line(1062.0, "unified", 1990, 3, 8, 49.0, "plan:1000,launch:3000,wait:44000,apply:1000"),
    line(1068.0, "decode_ahead", 0, 0, 8, 5.5),
    line(9068.0, "decode_ahead", 0, 0, 8, 5.5),  # after an idle gap of 8 s: not an interval
]


def test_step_intervals_by_kind_and_prefill_size():
    records = parse_steps(LOG)
    assert len(records) == 6
    assert [i.ms for i in intervals(records)] == [6.0, 6.0, 50.0, 6.0]
    stats = {s.name: s for s in summarize(records)}
    overall = stats["steps with decode rows"]
    # numpy's linear percentile, as bench serve's ITL p99: 6 + 0.97 * (50 - 6)
    assert (overall.count, overall.median_ms, overall.max_ms) == (4, 6.0, 50.0)
    assert overall.p99_ms == pytest.approx(48.68)
    assert (stats["kind decode_ahead"].count, stats["kind decode_ahead"].max_ms) == (3, 6.0)
    assert (stats["kind unified"].count, stats["kind unified"].step_median_ms) == (1, 49.0)
    assert stats["prefill 0"].count == 3 and stats["prefill 1025-2048"].count == 1
    assert "prefill 1-256" not in stats  # empty groups are left out
    unified = stats["kind unified"].phase_median_ms
    assert unified == {"plan": 1.0, "launch": 3.0, "wait": 44.0, "apply": 1.0}
    assert stats["kind decode_ahead"].phase_median_ms["wait"] == 0.0  # logged without phases


def test_each_runs_time_splits_into_prompt_steps_decode_only_steps_before_the_last_prompt_and_the_tail():
    log = [
        line(1000.0, "prefill", 100, 1, 0, 10.0),  # a run's first step counts its own duration
        line(1020.0, "decode_ahead", 0, 0, 4, 5.0),  # decode only, a prompt still to come: 20 ms
        line(1050.0, "unified", 50, 1, 4, 30.0),
        line(1056.0, "decode_ahead", 0, 0, 4, 6.0),  # the tail
        line(1062.0, "decode_ahead", 0, 0, 2, 6.0),
        line(2500.0, "idle", 0, 0, 0, 1.0),  # feeds nothing: not a step of a run
        line(3000.0, "decode_ahead", 0, 0, 1, 5.0),  # started 1,933 ms after the last step: a new run
        line(5000.0, "prefill", 8192, 1, 0, 1800.0),  # started 200 ms after the step before: the same run
    ]
    found = runs(parse_steps(log))
    assert [len(r) for r in found] == [5, 2]
    a, b = (split_run(r) for r in found)
    assert a.with_prompts == TimeShare(2, pytest.approx(0.040), 154)
    assert a.decode_only_prompts_to_come == TimeShare(1, pytest.approx(0.020), 4)
    assert a.decode_only_tail == TimeShare(2, pytest.approx(0.012), 6)
    assert a.seconds == pytest.approx(0.072)
    assert a.with_prompts.tokens_per_s == pytest.approx(154 / 0.040)
    assert b.with_prompts == TimeShare(1, pytest.approx(2.0), 8192)
    assert b.decode_only_prompts_to_come == TimeShare(1, pytest.approx(0.005), 1)
    assert b.decode_only_tail == TimeShare() and b.decode_only_tail.tokens_per_s == 0.0


def test_device_and_idle_times_parse_and_sum_per_run(tmp_path, capsys):
    timed = [
        line(1000.0, "prefill", 100, 1, 0, 10.0) + " device_us=9000",  # the stream's first: no idle time
        line(1020.0, "decode_ahead", 0, 0, 4, 5.0),  # logged at its launch: no device time
        line(1040.0, "decode_ahead", 0, 0, 4, 5.0) + " device_us=4000 idle_us=1500",
        line(1060.0, "unified", 50, 1, 4, 30.0, "plan:1000,launch:3000") + " device_us=28000 idle_us=500",
        line(1080.0, "decode_ahead", 0, 0, 4, 5.0) + " device_us=4000 idle_us=0",
    ]
    records = parse_steps(timed)
    assert [(r.device_us, r.idle_us) for r in records] == [
        (9000, None),
        (None, None),
        (4000, 1500),
        (28000, 500),
        (4000, 0),
    ]
    assert records[3].phases_us == (("plan", 1000), ("launch", 3000))  # the fields before still parse
    assert device_time(records) == DeviceTime(
        4, pytest.approx(0.045), pytest.approx(0.002), 0.5, pytest.approx(1.48), 1.5
    )
    assert device_time(records[1:2]) is None
    # A run's first launch waited for the run's requests, not for the host: its idle time is left out,
    # also where its launch line (no device time) opens the run.
    assert device_time(records[1:]) == DeviceTime(
        3, pytest.approx(0.036), pytest.approx(0.0005), 0.25, 0.495, 0.5
    )
    log = tmp_path / "server.log"
    log.write_text("\n".join(timed) + "\n")
    run_bench_steps(argparse.Namespace(logs=[str(log)], slowest=0))
    out = capsys.readouterr().out
    assert "device time per run" in out
    assert "    1     0.09      4     0.04    0.00    0.50    1.48    1.50" in out
    report = tmp_path / "bench-steps.txt"  # what `bench matrix` writes beside a step-logged server log
    assert write_report(log, report, slowest=0) and report.read_text() == out
    quiet = tmp_path / "quiet.log"
    quiet.write_text("2026-12-01 12:00:00,001 deltaserve.server INFO no step lines\n")
    assert not write_report(quiet, tmp_path / "none.txt") and not (tmp_path / "none.txt").exists()
    assert not write_report(tmp_path / "missing.log", tmp_path / "none.txt")


def test_step_phases_parse_and_repeat():
    from deltaserve.bench.step_log import phase_ms

    (record,) = parse_steps(
        [line(5.0, "decode_ahead", 0, 0, 4, 3.0, "plan:100,launch:200,wait:2500,apply:150")]
    )
    assert record.phases_us == (("plan", 100), ("launch", 200), ("wait", 2500), ("apply", 150))
    (record,) = parse_steps([line(5.0, "overlap_wait", 0, 0, 4, 3.0, "wait:500,apply:10,wait:700")])
    assert phase_ms(record, "wait") == 1.2


def test_allocations_that_can_stall_a_step_are_counted_and_logged(caplog, monkeypatch):
    from deltaserve.engine.scheduler import telemetry
    from deltaserve.ops.alloc_counters import counts_since
    from deltaserve.ops.pinned import PINNED

    before = {"cuda_malloc": 3, "alloc_retry": 0, "host_alloc": 7, "pinned": 2}
    after = {"cuda_malloc": 4, "alloc_retry": 0, "host_alloc": 7, "pinned": 4}
    assert counts_since(before, after) == {"cuda_malloc": 1, "pinned": 2}
    with caplog.at_level("INFO", logger="deltaserve.itl"):
        telemetry.log_itl_step("decode", 0, 0, 2, 1.0, 1.002)  # the first line: nothing to compare with
        monkeypatch.setattr(PINNED, "allocated", PINNED.allocated + 1)  # a pinned buffer allocated
        telemetry.log_itl_step("decode", 0, 0, 2, 1.002, 1.004)
    first, second = (parse_steps([r.getMessage()])[0] for r in caplog.records)
    assert (first.allocs, second.allocs) == ("", "pinned:1")


class FakeSpan:
    """A device span whose times are given (CUDA events exist on GPUs only)."""

    def __init__(self, device_ms: float, idle_ms: float | None, done: bool = True) -> None:
        self.done, self._device, self._idle = done, device_ms, idle_ms

    def device_ms(self) -> float:
        return self._device

    def idle_ms(self) -> float | None:
        return self._idle


def test_a_step_line_carries_its_device_and_idle_time_once_the_step_is_done(caplog):
    from deltaserve.engine.scheduler import telemetry

    assert telemetry.device_fields(None) == ""
    assert telemetry.device_fields(FakeSpan(3.0, 0.2, done=False)) == ""  # logged at its launch
    assert telemetry.device_fields(FakeSpan(3.0, None)) == " device_us=3000"  # the stream's first
    assert telemetry.device_fields(FakeSpan(3.25, 0.0125)) == " device_us=3250 idle_us=12"
    with caplog.at_level("INFO", logger="deltaserve.itl"):
        telemetry.log_itl_step("decode", 0, 0, 2, 1.0, 1.004, FakeSpan(3.5, 0.25))
    (record,) = parse_steps([r.getMessage() for r in caplog.records])
    assert (record.step_us, record.device_us, record.idle_us) == (4000, 3500, 250)


def test_forward_shapes_parse_and_name_the_field_when_wrong():
    assert parse_shape("61x1@1100+1x512@0") == [RowGroup(61, 1, 1100), RowGroup(1, 512, 0)]
    rows = shape_rows(parse_shape("2x1@20+1x5@0"), page_size=16, vocab_size=1000)
    assert [(len(r.token_ids), r.context_len, len(r.pages)) for r in rows] == [
        (1, 20, 2),
        (1, 20, 2),
        (5, 0, 1),
    ]
    for bad in ("61x1", "ax1@0", "0x1@0", "1x1@-1"):
        with pytest.raises(ValueError, match="--shape"):
            parse_shape(bad)


def test_forward_shape_rows_spread_token_ids_over_the_vocabulary():
    """One repeated id would route every row of a MoE model to the same experts (an unreal expert load)."""
    rows = shape_rows(parse_shape("64x1@20+2x512@0"), page_size=16, vocab_size=1000)
    ids = [t for r in rows for t in r.token_ids]
    assert all(0 <= t < 1000 for t in ids)
    assert len(set(ids)) > 500  # 1088 draws over 1000 ids: ~660 distinct expected
    again = shape_rows(parse_shape("64x1@20+2x512@0"), page_size=16, vocab_size=1000)
    assert [r.token_ids for r in again] == [r.token_ids for r in rows]  # a fixed seed: runs compare


def _bench_forward_on_cpu(
    *shapes: str, num_iters: int = 2, kernels: int = 0, operators: int = 0, tp: int = 1
):
    args = argparse.Namespace(
        shape=list(shapes),
        num_iters=num_iters,
        num_iters_warmup=0,
        output_json=None,
        kernels=kernels,
        operators=operators,
    )
    config = EngineConfig(device="cpu", max_model_len=256, max_num_seqs=4, tensor_parallel_size=tp)
    return run_bench_forward(args, config)


def test_bench_forward_runs_on_cpu(capsys):
    results = _bench_forward_on_cpu("1x1@0", "2x1@8+1x6@0", num_iters=1)
    assert [r.shape for r in results] == ["1x1@0", "2x1@8+1x6@0"]
    assert all(r.eager_wall_ms >= r.eager_host_ms > 0 and r.worker_wall_ms > 0 for r in results)
    assert "2x1@8+1x6@0" in capsys.readouterr().out


def test_bench_forward_lists_where_a_forward_spends_its_time_without_starting_the_scheduler(
    capsys, monkeypatch
):
    """The forwards run on the caller's thread: a started scheduler captures graphs on the same device
    while idle, and a capture breaks when another thread launches kernels during it."""

    def refuse(self, publish):
        raise AssertionError("bench forward started the scheduler")

    monkeypatch.setattr(EngineCore, "start", refuse)
    (result,) = _bench_forward_on_cpu("1x6@0", kernels=3)
    kernels = result.kernels
    assert len(kernels) > 3 and sum(k.share for k in kernels) == pytest.approx(1.0)
    assert [k.us for k in kernels] == sorted((k.us for k in kernels), reverse=True)
    assert any("mm" in k.name for k in kernels)  # the projections, as CPU operators
    assert result.worker_kernels and any("mm" in k.name for k in result.worker_kernels)
    out = capsys.readouterr().out
    assert "kernels of 1x6@0 (eager)" in out and f"({len(kernels) - 3} others)" in out
    assert "kernels of 1x6@0 (worker)" in out


def test_bench_forward_names_the_operators_behind_the_time_with_their_input_shapes(capsys):
    (result,) = _bench_forward_on_cpu("1x6@0", operators=2)
    operators = result.operators
    assert len(operators) > 2 and sum(o.share for o in operators) == pytest.approx(1.0)
    assert [o.us for o in operators] == sorted((o.us for o in operators), reverse=True)
    assert all(o.name.startswith("aten::") or "::" in o.name for o in operators[:5])
    # The tiny model's projections run on 6 token rows: some operator's recorded inputs say so.
    assert any("[6, " in o.shapes for o in operators)
    assert not result.kernels  # only what was asked for
    out = capsys.readouterr().out
    assert "operators of 1x6@0 (eager)" in out and f"({len(operators) - 2} others)" in out


def test_bench_forward_runs_every_rank_under_tensor_parallelism():
    """Both paths go through rank 0's worker, so rank 1 runs each forward too (rank 0's model alone
    would wait in its first all-reduce); the kernel tables then list the all-reduces."""
    (result,) = _bench_forward_on_cpu("2x1@8+1x6@0", num_iters=1, kernels=40, tp=2)
    assert result.eager_wall_ms > 0 and result.worker_wall_ms > 0
    assert any("allreduce" in k.name for k in result.kernels), [k.name for k in result.kernels]


def test_a_step_launched_ahead_counts_once_in_the_time_split_though_two_ticks_describe_it():
    # Two 8,192-token prompts, one after the other, each launched ahead by one tick (plan, launch) and
    # delivered by the next (wait, apply): four lines, two steps.
    log = [
        line(1000.0, "prefill_ahead", 8192, 1, 0, 80.0, "plan:200,launch:79800"),
        line(1046.0, "prefill_ahead", 8192, 1, 0, 46.0, "wait:45500,apply:500")
        + " device_us=125000 idle_us=0",
        line(1136.0, "prefill_ahead", 8192, 1, 0, 80.0, "plan:200,launch:79800"),
        line(1182.0, "prefill_ahead", 8192, 1, 0, 46.0, "wait:45500,apply:500")
        + " device_us=125000 idle_us=9",
    ]
    records = parse_steps(log)
    assert [r.launched_only for r in records] == [True, False, True, False]
    (run,) = runs(records)
    assert split_run(run).with_prompts == TimeShare(2, pytest.approx(0.262), 2 * 8192)
