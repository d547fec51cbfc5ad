"""The scheduler on a small random model: batching invariance, seeded sampling, lifecycle, bad input."""

from __future__ import annotations

import random
from pathlib import Path

import hf_oracle
import pytest
from scheduler_harness import LOGPROB_TOL, VOCAB, Run, load_model

from deltaserve.engine.protocol import AddRequest
from deltaserve.engine.scheduler import Phase, telemetry
from deltaserve.sampling_params import SamplingParams

GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("sched_model")
    hf_oracle.save_text_layout(hf_oracle.build_hf_causal_lm(seed=11, layers=4, tied=True), out)
    return load_model(Path(out))


def prompts_mixed(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 300, 2, 17, 64, 65, 3, 150, 31, 5, 200, 8, 99, 1, 40, 250][:n]
    return [[rng.randrange(VOCAB) for _ in range(L)] for L in lengths]


@pytest.fixture(scope="module")
def alone(model) -> list[list[int]]:
    """Each prompt's greedy output when it runs alone."""
    outs = []
    for i, p in enumerate(prompts_mixed()):
        run = Run(model)
        run.add(f"r{i}", p, GREEDY8)
        run.run_until_idle()
        outs.append(run.tokens(f"r{i}"))
    return outs


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
@pytest.mark.parametrize("budget", [1, 7, 64, 4096])
def test_batched_outputs_equal_each_prompt_alone(model, alone, budget, max_num_seqs):
    """Requests arrive while others decode; chunking, packing and batch composition change nothing."""
    run = Run(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    prompts = prompts_mixed()
    for i, p in enumerate(prompts[:8]):
        run.add(f"r{i}", p, GREEDY8)
    run.tick(40)
    for i, p in enumerate(prompts[8:], start=8):
        run.add(f"r{i}", p, GREEDY8)
        run.tick(3)
    run.run_until_idle()
    for i in range(len(prompts)):
        assert run.terminal(f"r{i}").finish_reason == "length"
        assert run.tokens(f"r{i}") == alone[i], f"request {i} (prompt {len(prompts[i])} tokens)"
    assert run.sched.load.kv_pages_used == 0 and run.sched.load.running == 0


def test_unified_step_is_one_forward_over_decode_rows_and_chunks(model):
    run = Run(model, max_num_batched_tokens=16)
    calls = []
    launch = run.sched.backend.launch
    run.sched.backend.launch = lambda plan: (
        calls.append([len(r.token_ids) for r in plan.rows]) or launch(plan)
    )
    run.add("a", [1, 2, 3], GREEDY8)
    run.tick()  # prefill a
    run.add("b", list(range(40)), GREEDY8)
    run.tick()  # a decodes while b's first chunk prefills: one call, decode row first
    assert calls[-1] == [1, 15]


def test_seeded_sampling_is_independent_of_batch_companions(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone_run = Run(model)
    alone_run.add("s", [5, 6, 7, 8], params)
    alone_run.run_until_idle()
    busy = Run(model, max_num_batched_tokens=9)
    busy.add("x", list(range(30)), SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True))
    busy.add("g", [9, 9, 9], GREEDY8)
    busy.tick(2)
    busy.add("s", [5, 6, 7, 8], params)
    busy.add(
        "y", list(range(50, 70)), SamplingParams(temperature=1.3, seed=99, max_tokens=5, ignore_eos=True)
    )
    busy.run_until_idle()
    assert busy.tokens("s") == alone_run.tokens("s")
    other = Run(model)
    other.add(
        "s",
        [5, 6, 7, 8],
        SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12, ignore_eos=True),
    )
    other.run_until_idle()
    assert other.tokens("s") != alone_run.tokens("s")


def test_eos_stop_ids_min_tokens_and_max_tokens(model):
    run = Run(model, eos=(7,))
    probe = Run(model)
    probe.add("p", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    probe.run_until_idle()
    greedy = probe.tokens("p")
    # make the 3rd greedy token an EOS id: the request stops there (the EOS id is the last token)
    run = Run(model, eos=(greedy[2],))
    run.add("eos", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6))
    run.add("ignore", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    run.add(
        "stop_id",
        [1, 2, 3],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[greedy[1]]),
    )
    run.run_until_idle()
    assert run.tokens("eos") == greedy[:3] and run.terminal("eos").finish_reason == "stop"
    assert run.tokens("ignore") == greedy and run.terminal("ignore").finish_reason == "length"
    end = run.terminal("stop_id")
    assert run.tokens("stop_id") == greedy[:2] and (end.finish_reason, end.stop_reason) == ("stop", greedy[1])
    # min_tokens suppresses the stop id until enough tokens exist
    mt = Run(model, eos=(greedy[0],))
    mt.add("m", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3))
    mt.run_until_idle()
    toks = mt.tokens("m")
    assert len(toks) >= 3 and greedy[0] not in toks[:3]


def test_disconnect_while_queued_prefilling_and_decoding_frees_pages_and_slot_same_tick(model):
    run = Run(model, max_num_seqs=2, max_num_batched_tokens=8)
    run.add("decoding", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    run.add("prefilling", list(range(100)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    run.add("queued", list(range(10)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    run.tick(3)
    phases = {rid: run.sched.by_id[rid].phase for rid in ("decoding", "prefilling", "queued")}
    assert phases == {"decoding": Phase.RUNNING, "prefilling": Phase.PREFILLING, "queued": Phase.WAITING}
    for rid in ("decoding", "prefilling", "queued"):
        run.abort(rid)
    run.tick()
    assert run.sched.load.kv_pages_used == 0
    assert (
        run.sched.load.state_slots_free == 2 and run.sched.load.running == 0 and run.sched.load.waiting == 0
    )
    for rid in ("decoding", "prefilling", "queued"):
        assert run.terminal(rid).finish_reason == "abort"


def test_disconnect_during_inflight_async_prefill_drains_it_then_frees_in_the_same_tick(model):
    run = Run(model, max_num_batched_tokens=16, prefill_overlap=True)
    run.add("dec", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    run.tick()
    run.add("long", list(range(60)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    run.tick()  # launches long's first chunk asynchronously while "dec" decodes
    inflight = run.sched.inflight
    assert inflight is not None and [r.request_id for r in inflight.requests] == ["long"]
    req = run.sched.by_id["long"]
    assert req.phase is Phase.INFLIGHT and req not in run.sched.prefilling and req not in run.sched.running
    run.abort("long")
    run.tick()
    assert run.sched.inflight is None
    assert "long" not in run.sched.by_id and run.terminal("long").finish_reason == "abort"
    assert run.sched.load.running == 1  # only "dec"; long's pages and slot are free
    assert run.sched.load.kv_pages_used == run.sched.cache.kv.pages_for(run.sched.by_id["dec"].num_computed)


def test_overlap_path_gives_the_same_tokens(model, alone):
    run = Run(model, max_num_batched_tokens=32, prefill_overlap=True)
    prompts = prompts_mixed()
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, GREEDY8)
        run.tick()
    run.run_until_idle()
    for i in range(len(prompts)):
        assert run.tokens(f"r{i}") == alone[i]


def test_shutdown_gives_every_owned_request_exactly_one_terminal(model):
    from deltaserve.engine.protocol import Shutdown

    run = Run(model, max_num_seqs=3, max_num_batched_tokens=8, prefill_overlap=True)
    for i in range(6):
        run.add(
            f"r{i}",
            list(range(1, 3 + 20 * i)),
            SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
        )
    run.tick(4)
    phases = {r.phase for r in run.sched.by_id.values()}
    assert {Phase.WAITING, Phase.RUNNING} <= phases
    run.add("late", [1, 2, 3])  # still in the inbox when the shutdown is drained
    run.sched.submit(Shutdown("test shutdown"))
    run.add("after", [1, 2, 3])
    run.tick()
    for rid in [f"r{i}" for i in range(6)] + ["late", "after"]:
        end = run.terminal(rid)
        assert end.finish_reason == "error" and "test shutdown" in end.error
    assert run.loads[-1].running == 0 and run.loads[-1].kv_pages_used == 0
    assert run.sched.cache.kv.num_used == 0 and run.sched.cache.states.num_free == 3


def test_fatal_error_fans_out_one_error_per_request_and_zero_load(model):
    run = Run(model)
    for i in range(4):
        run.add(
            f"r{i}", list(range(1, 10 + i)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        )
    run.tick(2)

    def broken(plan):
        raise RuntimeError("device lost")

    run.sched.backend.launch = broken
    with pytest.raises(RuntimeError, match="device lost"):
        run.sched.run()
    for i in range(4):
        end = run.terminal(f"r{i}")
        assert end.finish_reason == "error" and "device lost" in end.error
    assert run.loads[-1].running == 0 and run.loads[-1].kv_pages_used == 0


def test_a_prefill_step_that_fails_still_gives_its_requests_their_terminal(model):
    """The failing step's prefill chunks are off the prefilling FIFO while it runs: the fatal path
    must still reach their requests (and the decoding ones)."""
    run = Run(model)
    run.add("decoding", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    run.tick(2)
    for i in range(3):
        run.add(f"new{i}", list(range(1, 8 + i)), SamplingParams(temperature=0.0, max_tokens=5))

    def broken(plan):
        assert any(len(row.token_ids) > 1 for row in plan.rows), "the failing step carries prefill chunks"
        raise RuntimeError("device lost")

    run.sched.backend.launch = broken
    with pytest.raises(RuntimeError, match="device lost"):
        run.sched.run()
    for rid in ("decoding", "new0", "new1", "new2"):
        end = run.terminal(rid)
        assert end.finish_reason == "error" and "device lost" in end.error
    assert run.loads[-1].running == 0 and run.loads[-1].kv_pages_used == 0
    assert run.sched.cache.kv.num_used == 0


def _ample_and_tight(
    model,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    seqs: int,
    pages: int,
    budget: int,
    kv_reserve_tokens: int = 1,
) -> tuple[Run, Run]:
    """The requests r0, r1, ... run to the end on an ample pool (`seqs` sequences), then on `pages`
    pages, half the sequences and `budget`-token steps: a pool short of pages preempts (recompute), as
    admission is optimistic unless `kv_reserve_tokens` says otherwise."""
    free = Run(model, max_num_seqs=seqs, num_pages=4096)
    tight = Run(
        model,
        max_num_seqs=seqs // 2,
        num_pages=pages,
        max_num_batched_tokens=budget,
        kv_reserve_tokens=kv_reserve_tokens,
    )
    for run in (free, tight):
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            run.add(f"r{i}", p, sp)
        run.run_until_idle()
    return free, tight


def _pressure_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 24))] for _ in range(64)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(20, 48), ignore_eos=True) for _ in prompts
    ]
    params[10] = SamplingParams(
        temperature=0.0, max_tokens=600, ignore_eos=True
    )  # can never fit: 128 pages x 4
    return prompts, params


def test_kv_pressure_every_request_finishes_or_is_rejected_and_outputs_match(model):
    """64 requests with large max_tokens on a pool far too small for all at once: recompute preemption
    lets each finish with the same tokens as an unpressured run; impossible ones are rejected."""
    prompts, params = _pressure_workload()
    free, tight = _ample_and_tight(model, prompts, params, seqs=64, pages=129, budget=64)
    assert tight.sched.num_preemptions > 0
    for i in range(64):
        end = tight.terminal(f"r{i}")
        if i == 10:
            assert end.finish_reason == "rejected" and "more than this instance holds (128)" in end.error
            continue
        assert end.finish_reason == "length", end
        assert tight.tokens(f"r{i}") == free.tokens(f"r{i}"), f"request {i}"
    assert tight.sched.cache.kv.num_used == 0


def test_the_growth_reserve_lets_every_request_finish_without_preemption(model):
    """The same pressure with admission keeping each admitted request's next 64 tokens (more than any
    max_tokens here but the rejected one): nobody is preempted, and the tokens are the same."""
    prompts, params = _pressure_workload()
    free, tight = _ample_and_tight(
        model, prompts, params, seqs=64, pages=129, budget=64, kv_reserve_tokens=64
    )
    assert tight.sched.num_preemptions == 0
    for i in range(64):
        if i != 10:
            assert tight.terminal(f"r{i}").finish_reason == "length"
            assert tight.tokens(f"r{i}") == free.tokens(f"r{i}"), f"request {i}"
    assert tight.terminal("r10").finish_reason == "rejected"
    assert tight.sched.cache.kv.num_used == 0


def test_admission_counts_the_pages_a_finishing_decoder_returns_before_the_reserve_needs_them(model):
    """16 pages of 4 tokens, a reserve of 64 tokens. x (4 + 6 tokens) is near its end and y (4 + 40) has
    most of its growth ahead when z (8 + 8) arrives; both finish within the reserve. Summing their
    reserves promises x's last pages and y's whole growth together, so z would wait for x to finish; x's
    pages come back after a few steps, before y takes most of its own, so z starts at once. Nobody is
    preempted and the tokens are those of an ample pool."""

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    requests = [("x", [1, 2, 3, 4], greedy(6)), ("y", [5, 6, 7, 8], greedy(40)), ("z", [9] * 8, greedy(8))]
    ample = Run(model, max_num_seqs=4, num_pages=4096)
    for rid, prompt, params in requests:
        ample.add(rid, prompt, params)
    ample.run_until_idle()
    tight = Run(model, max_num_seqs=4, num_pages=16, kv_reserve_tokens=64)
    for rid, prompt, params in requests[:2]:
        tight.add(rid, prompt, params)
    tight.tick(2)
    tight.add(*requests[2])
    ticks = 0
    while not tight.tokens("z"):
        tight.tick()
        ticks += 1
    assert ticks <= 2 and not tight.terminals("x")
    tight.run_until_idle()
    assert tight.sched.num_preemptions == 0
    for rid, _, _ in requests:
        assert tight.terminal(rid).finish_reason == "length"
        assert tight.tokens(rid) == ample.tokens(rid)


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ([0, 5, VOCAB - 1], None),
        ([1, -1], f"prompt token 1 must be a token id in [0, {VOCAB}), got -1"),
        ([1, 2, VOCAB], f"prompt token 2 must be a token id in [0, {VOCAB}), got {VOCAB}"),
        ([True, 2], f"prompt token 0 must be a token id in [0, {VOCAB}), got True"),
        ([1, 2.0], f"prompt token 1 must be a token id in [0, {VOCAB}), got 2.0"),
        ([1, "7"], f"prompt token 1 must be a token id in [0, {VOCAB}), got '7'"),
    ],
)
def test_prompt_token_checks_name_the_first_bad_entry(prompt, problem):
    from deltaserve.engine.scheduler.validation import _prompt_token_problem

    assert _prompt_token_problem(prompt, VOCAB) == problem


@pytest.mark.parametrize(
    ("prompt", "params", "field", "message"),
    [
        ([], SamplingParams(max_tokens=4), "prompt", "at least one token"),
        (
            list(range(100)),
            SamplingParams(max_tokens=2000),
            "max_tokens",
            "exceeds the context window of 2048",
        ),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature", "got -1.0"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature", "got nan"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p", "in (0, 1], got 0.0"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p", "got 1.5"),
        ([1, VOCAB + 3], SamplingParams(max_tokens=4), "prompt", f"in [0, {VOCAB}), got {VOCAB + 3}"),
        ([1, 2], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids", str(VOCAB)),
    ],
)
def test_bad_input_is_rejected_naming_the_field_and_others_are_served(model, prompt, params, field, message):
    run = Run(model)
    run.add("good1", [1, 2, 3], GREEDY8)
    run.add("bad", prompt, params)
    run.add("good2", [4, 5, 6], GREEDY8)
    run.run_until_idle()
    end = run.terminal("bad")
    assert end.finish_reason == "rejected" and end.error_field == field and message in end.error
    ref = Run(model)
    ref.add("good1", [1, 2, 3], GREEDY8)
    ref.add("good2", [4, 5, 6], GREEDY8)
    ref.run_until_idle()
    assert run.tokens("good1") == ref.tokens("good1") and run.tokens("good2") == ref.tokens("good2")


def test_unsupported_contracts_are_rejected_fail_closed(model):
    from deltaserve.engine.protocol import AddRequest

    run = Run(model)
    run.sched.submit(AddRequest("echo", [1, 2], GREEDY8, echo=True))
    run.add("n2", [1, 2], SamplingParams(n=2))
    run.add("plp", [1, 2], SamplingParams(prompt_logprobs=21))
    run.run_until_idle()
    assert "echo=true is not supported" in run.terminal("echo").error
    assert run.terminal("n2").error_field == "n" and run.terminal("plp").error_field == "prompt_logprobs"


def test_auto_policy_runs_decode_only_ticks_near_a_finish(model):
    run = Run(model, policy="auto", max_num_batched_tokens=64)
    calls = []
    launch = run.sched.backend.launch
    run.sched.backend.launch = lambda plan: (
        calls.append([len(r.token_ids) for r in plan.rows]) or launch(plan)
    )
    run.add("short", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    run.tick()  # prefill "short": 1 token out, 2 left (<= 4: within the finish window)
    run.add("long", list(range(100)), GREEDY8)
    run.tick()
    assert calls[-1] == [1]  # decode only: the finishing request is not stalled by a prefill
    run.run_until_idle()
    assert run.terminal("long").finish_reason == "length"


def test_itl_telemetry_is_free_when_off_and_one_line_per_step_when_on(model, monkeypatch, caplog):
    import deltaserve.engine.scheduler.steps as steps

    clock_reads = []
    real = steps.time.monotonic
    monkeypatch.setattr(steps.time, "monotonic", lambda: clock_reads.append(1) or real())
    monkeypatch.setattr(telemetry, "ITL_DEBUG", False)
    run = Run(model)
    run.add("a", [1, 2, 3], GREEDY8)
    run.tick()  # prefill: first-token timestamp is the step's own clock read
    clock_reads.clear()
    run.tick(3)  # pure decode steps
    assert clock_reads == []
    monkeypatch.setattr(telemetry, "ITL_DEBUG", True)
    with caplog.at_level("INFO", logger="deltaserve.itl"):
        run.tick(2)
    lines = [r.getMessage() for r in caplog.records if "ITL_STEP" in r.getMessage()]
    assert len(lines) == 2 and "kind=decode" in lines[0] and "decode_rows=1" in lines[0]
    phases = [item.split(":")[0] for item in lines[1].split("phases_us=")[1].split(",")]
    assert phases == ["plan", "launch", "wait", "apply"]  # the step's host time, where it went


def test_each_step_line_describes_the_step_its_tick_delivered(model, monkeypatch, caplog):
    # Under launch-ahead a tick launches step N + 1 and delivers step N: a decoder's inter-token
    # interval ends with N, so the line describes N (a tick that only launched describes that launch).
    monkeypatch.setattr(telemetry, "ITL_DEBUG", True)
    run = Run(model, max_num_batched_tokens=16)
    with caplog.at_level("INFO", logger="deltaserve.itl"):
        run.add("a", [1, 2, 3], GREEDY8)
        run.tick()  # launches a's prefill
        run.add("b", list(range(40)), GREEDY8)
        run.tick(2)  # launches a's decode row + b's chunks; delivers a's prefill, then the unified step
    lines = [r.getMessage() for r in caplog.records if "ITL_STEP" in r.getMessage()]
    described = [
        tuple(
            part.split("=")[1]
            for part in line.split()
            if part.split("=")[0] in ("kind", "prefill_tokens", "decode_rows")
        )
        for line in lines
    ]
    assert described == [
        ("prefill_ahead", "3", "0"),
        ("prefill_ahead", "3", "0"),
        ("unified_ahead", "15", "1"),
    ]
    assert "wait" not in lines[0] and "wait" in lines[1]  # the first tick read nothing


def test_each_step_line_carries_the_device_time_of_the_step_it_describes(model, monkeypatch, caplog):
    # A backend timing its steps (CUDA) gives each launch a device span; here the k-th launch's span
    # says k ms. The line of a tick that delivered a step launched ahead carries that step's span, not
    # the span of the step the same tick launched after it.
    from types import SimpleNamespace

    from deltaserve.engine.backend import Backend

    launches = []
    real_launch = Backend.launch

    def timed_launch(self, plan, overlapped=False):
        pending = real_launch(self, plan, overlapped)
        launches.append((len(plan.decode), sum(len(r.token_ids) for r in plan.prefill)))
        k = len(launches)
        pending.device_span = SimpleNamespace(done=True, device_ms=lambda: float(k), idle_ms=lambda: k / 10)
        return pending

    monkeypatch.setattr(Backend, "launch", timed_launch)
    monkeypatch.setattr(telemetry, "ITL_DEBUG", True)
    run = Run(model, max_num_batched_tokens=16)
    with caplog.at_level("INFO", logger="deltaserve.itl"):
        run.add("a", [1, 2, 3], GREEDY8)
        run.tick()
        run.add("b", list(range(40)), GREEDY8)
        run.tick(2)
    lines = [r.getMessage() for r in caplog.records if "ITL_STEP" in r.getMessage()]
    described = [
        {k: v for k, v in (part.split("=", 1) for part in line.split() if "=" in part)} for line in lines
    ]
    launch_of = {
        (int(d["decode_rows"]), int(d["prefill_tokens"])): launches.index(
            (int(d["decode_rows"]), int(d["prefill_tokens"]))
        )
        + 1
        for d in described
    }
    for d in described:
        k = launch_of[(int(d["decode_rows"]), int(d["prefill_tokens"]))]
        assert (d["device_us"], d["idle_us"]) == (str(k * 1000), str(k * 100)), (d, launches)


def test_a_tick_that_delivers_the_last_step_and_launches_nothing_describes_that_step(
    model, monkeypatch, caplog
):
    # A one-token completion: its prefill is launched ahead, and the tick that reads it has nothing
    # left to launch. Its line is the prefill's, with the prefill's device time (not an idle tick's).
    from types import SimpleNamespace

    from deltaserve.engine.backend import Backend

    real_launch = Backend.launch

    def timed_launch(self, plan, overlapped=False):
        pending = real_launch(self, plan, overlapped)
        pending.device_span = SimpleNamespace(done=True, device_ms=lambda: 7.0, idle_ms=lambda: 0.0)
        return pending

    monkeypatch.setattr(Backend, "launch", timed_launch)
    monkeypatch.setattr(telemetry, "ITL_DEBUG", True)
    run = Run(model)
    with caplog.at_level("INFO", logger="deltaserve.itl"):
        run.add("a", list(range(20)), SamplingParams(temperature=0.0, max_tokens=1))
        run.tick(2)
    lines = [r.getMessage() for r in caplog.records if "ITL_STEP" in r.getMessage()]
    assert len(lines) == 2 and run.terminal("a").finish_reason == "length"
    assert "kind=prefill_ahead prefill_tokens=20" in lines[1] and "device_us=7000" in lines[1], lines


def test_invalid_policy_combinations_are_refused_before_the_model_loads(tmp_path):
    from deltaserve.engine.core import EngineCore
    from deltaserve.engine_config import EngineConfig
    from deltaserve.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot be combined with --prefill-overlap"):
        EngineCore(
            EngineConfig(
                model=str(tmp_path / "does-not-exist"), scheduler_policy="auto", prefill_overlap=True
            )
        )
    with pytest.raises(ConfigError, match="--scheduler-policy must be one of"):
        EngineCore(EngineConfig(model=str(tmp_path / "does-not-exist"), scheduler_policy="sjf"))


# ---- decode-ahead ------------------------------------------------------------------------------------


def assert_same_updates(a: Run, b: Run) -> None:
    """Tokens, finish, counts and logprob ranks/ids exactly; logprob values to LOGPROB_TOL (a batch of
    another size may round the last fp32 bits of a logit differently)."""
    assert a.updates.keys() == b.updates.keys()
    for rid in a.updates:
        ups_a, ups_b = a.updates[rid], b.updates[rid]
        assert len(ups_a) == len(ups_b), rid
        for u, v in zip(ups_a, ups_b, strict=True):
            assert (u.new_token_ids, u.finish_reason, u.stop_reason, u.num_output_tokens) == (
                v.new_token_ids,
                v.finish_reason,
                v.stop_reason,
                v.num_output_tokens,
            ), rid
            assert (u.new_logprobs is None) == (v.new_logprobs is None), rid
            for x, y in zip(u.new_logprobs or [], v.new_logprobs or [], strict=True):
                assert x.rank == y.rank and [t for t, _ in x.top] == [t for t, _ in y.top], rid
                assert x.logprob == pytest.approx(y.logprob, abs=LOGPROB_TOL), rid
                assert [p for _, p in x.top] == pytest.approx([p for _, p in y.top], abs=LOGPROB_TOL), rid


def _mixed_decode_workload(run: Run) -> None:
    """Greedy, seeded sampling with top-p, logprobs, min_tokens against EOS, a one-token request, and
    arrivals while others decode."""
    prompts = prompts_mixed(8, seed=3)
    eos_free = SamplingParams(temperature=0.0, max_tokens=12)  # EOS applies
    seeded = SamplingParams(temperature=0.9, top_p=0.8, seed=-7, max_tokens=10, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=9, logprobs=3, ignore_eos=True)
    min_tokens = SamplingParams(temperature=0.0, max_tokens=11, min_tokens=6)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, params in enumerate([eos_free, seeded, with_logprobs, min_tokens, one]):
        run.add(f"r{i}", prompts[i], params)
    run.tick(6)
    run.add("late0", prompts[5], eos_free)
    run.add("late1", prompts[6], seeded)
    run.run_until_idle()


def test_decode_ahead_gives_the_same_updates_as_reading_every_step(model):
    # EOS is a token the greedy requests produce a few steps in, so stops land mid-pipeline.
    probe = Run(model, decode_ahead=False)
    _mixed_decode_workload(probe)
    eos = (probe.tokens("r0")[3],)
    runs = {}
    for ahead in (False, True):
        runs[ahead] = Run(model, decode_ahead=ahead, eos=eos)
        _mixed_decode_workload(runs[ahead])
    assert_same_updates(runs[True], runs[False])
    assert runs[True].terminal("r0").finish_reason == "stop"
    for run in runs.values():
        assert run.sched.load.kv_pages_used == 0 and run.sched.load.state_slots_free == 16


def _log_launches(run: Run) -> list[tuple]:
    """Records ("launch", fed rows or None, rows) and ("wait",) in the order the scheduler does them."""
    log: list[tuple] = []
    launch = run.sched.backend.launch

    def logged(plan):
        pending = launch(plan)
        log.append(("launch", None if plan.feed is None else len(plan.feed.rows), len(plan.rows)))
        wait = pending.wait
        pending.wait = lambda: log.append(("wait",)) or wait()
        return pending

    run.sched.backend.launch = logged
    return log


def test_the_next_decode_step_is_launched_before_the_previous_tokens_are_read(model):
    run = Run(model)
    log = _log_launches(run)
    run.add("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    run.add("b", [4, 5], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    run.run_until_idle()
    fed = [i for i, entry in enumerate(log) if entry[0] == "launch" and entry[1] is not None]
    assert len(fed) >= 6
    # Each fed launch comes before the wait of the step it is fed from.
    assert all(log[i + 1] == ("wait",) for i in fed)
    assert len(run.tokens("a")) == len(run.tokens("b")) == 10


def test_length_limited_requests_get_no_step_past_their_last_token(model):
    # The first token comes from the prefill; each later one from one decode row, and no more.
    run = Run(model)
    log = _log_launches(run)
    for i, n in enumerate([1, 2, 5, 9]):
        run.add(f"r{i}", [7 + i, 8, 9], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    run.run_until_idle()
    decode_rows = sum(entry[2] for entry in log if entry[0] == "launch") - 4  # less the prefill rows
    assert decode_rows == (1 - 1) + (2 - 1) + (5 - 1) + (9 - 1)


def test_a_stop_token_mid_pipeline_costs_one_dropped_step_and_frees_everything(model):
    probe = Run(model, decode_ahead=False)
    probe.add("s", [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=20))
    probe.run_until_idle()
    stop_at = 4
    eos = probe.tokens("s")[stop_at]
    run = Run(model, eos=(eos,))
    log = _log_launches(run)
    run.add("s", [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=20))
    run.run_until_idle()
    tokens = run.tokens("s")
    assert tokens == probe.tokens("s")[: tokens.index(eos) + 1]
    assert run.terminal("s").finish_reason == "stop"
    decode_rows = sum(entry[2] for entry in log if entry[0] == "launch") - 1
    assert decode_rows == len(tokens)  # len(tokens) - 1 useful decode steps plus the dropped one
    assert run.sched.load.kv_pages_used == 0 and run.sched.load.state_slots_free == 16


def test_abort_while_a_step_is_ahead_emits_nothing_after_the_terminal(model):
    run = Run(model)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    run.add("gone", [1, 2, 3], long)
    run.add("kept", [4, 5, 6], GREEDY8)
    run.tick(4)
    assert run.sched.decode_ahead is not None and run.sched.by_id["gone"] in run.sched.decode_ahead.requests
    run.abort("gone")
    run.run_until_idle()
    assert run.terminal("gone").finish_reason == "abort"
    assert run.updates["gone"][-1].finished  # no token after the terminal
    alone = Run(model)
    alone.add("kept", [4, 5, 6], GREEDY8)
    alone.run_until_idle()
    assert run.tokens("kept") == alone.tokens("kept")
    assert run.sched.load.kv_pages_used == 0 and run.sched.load.state_slots_free == 16


PENALISED = {
    "rep": SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
    "freq": SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.8, ignore_eos=True),
    "pres": SamplingParams(temperature=0.7, seed=3, max_tokens=24, presence_penalty=1.5, ignore_eos=True),
}


def test_penalised_requests_decode_ahead_with_the_tokens_of_synchronous_steps(model):
    """Penalties count the outputs on the device, the token in flight included, so their requests
    launch ahead like any other, with the tokens of steps read one at a time."""
    outs = {}
    for ahead in (False, True):
        run = Run(model, decode_ahead=ahead)
        log = _log_launches(run)
        for name, params in PENALISED.items():
            run.add(name, [9, 9, 9, 2], params)
        run.add("q", [5, 6], GREEDY8)
        run.run_until_idle()
        outs[ahead] = {name: run.tokens(name) for name in [*PENALISED, "q"]}
        fed = [entry[1] for entry in log if entry[0] == "launch" and entry[1] is not None]
        assert bool(fed) == ahead
    assert outs[True] == outs[False]
    # The penalties act: greedy decoding of the same prompt without them repeats itself sooner.
    plain = Run(model)
    plain.add("rep", [9, 9, 9, 2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    plain.run_until_idle()
    assert plain.tokens("rep") != outs[True]["rep"]
    assert len(set(outs[True]["rep"])) > len(set(plain.tokens("rep")))


def test_penalised_requests_preempted_and_resumed_keep_their_tokens(model):
    """A request resumed after preemption gets a slot whose counts another request wrote: its row is
    rewritten from the outputs it has before it samples again."""
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 16))] for _ in range(24)]
    kinds = list(PENALISED.values())
    params = [kinds[i % 3] for i in range(24)]
    free, tight = _ample_and_tight(model, prompts, params, seqs=24, pages=65, budget=32)
    assert tight.sched.num_preemptions > 0
    for i in range(24):
        assert tight.tokens(f"r{i}") == free.tokens(f"r{i}"), f"request {i}"


def test_a_request_leaving_under_a_running_decode_step_keeps_its_caches_until_the_step_is_waited(model):
    # Guard: no KV or state is released under a launched step that may still write it.
    from deltaserve.engine.scheduler import lifecycle

    run = Run(model)
    run.add("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    run.add("y", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    run.tick(4)
    step = run.sched.decode_ahead
    assert step is not None and not step.waited
    slots_free, pages_used = run.sched.cache.states.num_free, run.sched.cache.kv.num_used
    run.sched.by_id["x"].closed = True
    lifecycle.prune_closed_requests(run.sched)  # what the next tick does first: x retires...
    assert "x" not in run.sched.by_id and run.sched.updates[-1].finish_reason == "abort"
    # ...but its slot and pages stay held while the step may still write them.
    assert run.sched.cache.states.num_free == slots_free and run.sched.cache.kv.num_used == pages_used
    run.tick()  # the step is waited for in this tick: x's slot and pages come back in it
    assert step.waited and run.sched.cache.states.num_free == slots_free + 1
    assert run.terminal("x").finish_reason == "abort"
    run.run_until_idle()
    assert run.sched.load.kv_pages_used == 0 and run.sched.load.state_slots_free == 16


def test_a_prompt_leaving_under_its_chunk_in_flight_keeps_its_caches_until_the_step_is_waited(model):
    # Guard: as above, for a step with prompt chunks launched ahead (its requests already requeued or
    # promoted at launch): neither the requeued prompt nor the promoted one frees anything under it.
    from deltaserve.engine.scheduler import lifecycle

    run = Run(model, max_num_batched_tokens=16)
    run.add("whole", [5, 6, 7], GREEDY8)  # all 3 tokens: promoted at launch, its first token in flight
    run.add("partial", list(range(40)), GREEDY8)  # 13 of 40 tokens: requeued at launch
    run.tick()
    step = run.sched.decode_ahead
    assert step is not None and not step.waited
    assert [(c.request.request_id, c.length) for c in step.chunks] == [("whole", 3), ("partial", 13)]
    assert run.sched.running == [run.sched.by_id["whole"]]
    assert list(run.sched.prefilling) == [run.sched.by_id["partial"]]
    slots_free, pages_used = run.sched.cache.states.num_free, run.sched.cache.kv.num_used
    for rid in ("partial", "whole"):
        run.sched.by_id[rid].closed = True
    lifecycle.prune_closed_requests(run.sched)
    assert run.sched.cache.states.num_free == slots_free and run.sched.cache.kv.num_used == pages_used
    run.run_until_idle()
    assert step.waited
    for rid in ("partial", "whole"):
        assert run.terminal(rid).finish_reason == "abort" and run.updates[rid][-1].finished
        assert run.tokens(rid) == []  # whole's first token, read after its abort, is not sent
    assert run.sched.load.kv_pages_used == 0 and run.sched.load.state_slots_free == 16


def test_a_first_token_that_stops_its_request_costs_one_dropped_row(model):
    probe = Run(model, decode_ahead=False)
    probe.add("s", [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=5))
    probe.run_until_idle()
    first = probe.tokens("s")[0]
    run = Run(model, eos=(first,))
    log = _log_launches(run)
    run.add("s", [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=5))
    run.run_until_idle()
    assert run.tokens("s") == [first] and run.terminal("s").finish_reason == "stop"
    # The prefill, then one decode row launched before the prefill's token was read, then dropped.
    assert [entry for entry in log if entry[0] == "launch"] == [("launch", None, 1), ("launch", 1, 1)]
    assert run.sched.load.kv_pages_used == 0 and run.sched.load.state_slots_free == 16


def test_prompt_logprobs_keep_the_prompt_steps_synchronous(model):
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    run = Run(model, max_num_batched_tokens=8)
    log = _log_launches(run)
    run.add("scored", list(range(20)), params)
    run.run_until_idle()
    launches = [i for i, entry in enumerate(log) if entry[0] == "launch"]
    # Every prompt chunk is read before the next step is launched; the decode steps after go ahead.
    assert [log[i + 1] for i in launches[:3]] == [("wait",)] * 3
    assert [log[i][1] for i in launches[3:]] == [None, 1, 1]  # decode: the first read, then fed
    assert len(run.tokens("scored")) == 4 and len(run.updates["scored"][0].prompt_logprobs) == 20


def test_shutdown_drains_a_running_decode_step_and_publishes_zero_load(model):
    from deltaserve.engine.protocol import Shutdown

    run = Run(model)
    run.add("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    run.tick(4)
    assert run.sched.decode_ahead is not None
    run.sched.submit(Shutdown("stopping"))
    run.tick()
    assert run.terminal("x").finish_reason == "error"
    assert run.loads[-1].kv_pages_used == 0 and run.loads[-1].state_slots_free == 16


class _StillRunning:
    """An async prefill's completion event while the device still runs it (engine/step.py)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_an_async_prefills_cache_work_settles_only_once_it_has_been_waited_for(model, monkeypatch):
    # On the GPU an async prefill runs on its own stream beside the decode steps launched after it: the
    # snapshot it writes must not be findable, nor the sources of its copies released for reuse, before
    # the scheduler has waited for it.
    run = Run(model, max_num_batched_tokens=16, prefill_overlap=True, num_snapshots=8)
    run.add("dec", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    run.tick()
    settled: list = []
    settle = run.sched.cache.launched
    monkeypatch.setattr(run.sched.cache, "launched", lambda work: (settled.append(work), settle(work)))
    run.add("long", list(range(1, 61)), SamplingParams(temperature=0.0, max_tokens=4), cache_points=[8])
    run.tick()  # long's first chunk, ending on its cache point, launched async while "dec" decodes
    inflight = run.sched.inflight
    assert inflight is not None and [r.request_id for r in inflight.requests] == ["long"]
    inflight.pending.finished = _StillRunning()
    snapshots = [snap for work in inflight.settle_at_wait for snap in work.writes]
    assert len(snapshots) == 1
    run.tick(3)  # "dec" decodes beside it; nothing of the async prefill's is settled
    assert run.sched.inflight is inflight and len(run.tokens("dec")) == 5
    assert not any(work in settled for work in inflight.settle_at_wait) and not snapshots[0].indexed
    inflight.pending.finished.done = True  # the device is done with it
    run.tick()
    assert run.sched.inflight is not inflight and snapshots[0].indexed
    run.run_until_idle()
    assert len(run.tokens("long")) == 4 and run.sched.load.kv_pages_used == 0


def test_bad_word_ends_are_the_tokens_that_would_complete_a_bad_word():
    from deltaserve.sampling_params import bad_word_ends

    words = [[5], [7, 8], [1, 2, 3]]
    assert bad_word_ends(words, []) == (5,)
    assert bad_word_ends(words, [9, 7]) == (5, 8)
    assert bad_word_ends(words, [4, 1, 2]) == (5, 3)
    assert bad_word_ends(words, [2, 1]) == (5,)


def test_bad_words_are_never_completed_with_or_without_decode_ahead(model):
    """A one-token bad word is never sampled; a two-token one never follows its first token. With
    decode-ahead the second needs the first on the host, so those steps run synchronously."""
    probe = Run(model)
    probe.add("p", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    probe.run_until_idle()
    greedy = probe.tokens("p")
    for decode_ahead in (True, False):
        run = Run(model, decode_ahead=decode_ahead)
        one = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[[greedy[0]]]
        )
        two = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[greedy[1:3]]
        )
        run.add("one", [1, 2, 3], one)
        run.add("two", [1, 2, 3], two)
        run.run_until_idle()
        assert greedy[0] not in run.tokens("one"), decode_ahead
        out = run.tokens("two")
        assert out[:2] == greedy[:2] and out[2] != greedy[2], (
            decode_ahead
        )  # the ban bites at its first chance
        assert all(out[i : i + 2] != greedy[1:3] for i in range(len(out) - 1)), decode_ahead


@pytest.mark.parametrize("seed", range(3))
def test_random_penalised_traffic_launched_ahead_gives_the_tokens_of_synchronous_steps(model, seed):
    """Arrivals over time, penalised requests beside plain ones, stop tokens, aborts and a pool short of
    pages (preemption): slots pass from request to request, and every request not aborted gets the
    same tokens and end launched ahead as read step by step."""
    rng = random.Random(seed)
    kinds = [
        *PENALISED.values(),
        GREEDY8,
        SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=1.5),
    ]
    events: dict[int, list] = {}
    names = [f"r{i}" for i in range(16)]
    for name in names:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        events.setdefault(rng.randrange(0, 10), []).append(("add", name, prompt, rng.choice(kinds)))
    aborted = set(rng.sample(names, 3))
    for name in aborted:
        events.setdefault(rng.randrange(0, 60), []).append(("abort", name))
    ends, preempted = {}, []
    for ahead in (False, True):
        run = Run(
            model,
            max_num_seqs=6,
            num_pages=28,
            max_num_batched_tokens=24,
            decode_ahead=ahead,
            eos=(7,),
            kv_reserve_tokens=1,  # optimistic admission: growth preempts
        )
        for tick in range(5000):
            for event in events.get(tick, []):
                if event[0] == "add":
                    run.add(event[1], event[2], event[3])
                else:
                    run.abort(event[1])
            if not run.sched.tick() and tick > 60:
                break
        ends[ahead] = {n: (run.tokens(n), run.terminal(n).finish_reason) for n in names if n not in aborted}
        assert run.sched.cache.kv.num_used == 0
        preempted.append(run.sched.num_preemptions)
    assert ends[True] == ends[False]
    assert max(preempted) > 0


def test_queue_time_ends_at_the_first_step_with_the_request_not_its_last_chunk(model, monkeypatch):
    # vllm:request_queue_time_seconds is arrival to the first scheduling: a prompt cut into three chunks
    # waits in no queue while its first two chunks run.
    now = [10.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    run = Run(model, max_num_batched_tokens=16)
    run.sched.submit(AddRequest("a", list(range(40)), GREEDY8, arrival_time=10.0))  # the client's clock
    for at in (11.0, 12.0, 13.0, 14.0, 15.0):  # chunks of 16, 16 and 8 tokens, then the first token
        now[0] = at
        run.tick()
    first = next(u for u in run.updates["a"] if u.new_token_ids)
    assert first.queued_time == pytest.approx(1.0)
