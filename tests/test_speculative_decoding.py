"""MTP speculative decoding on a small random checkpoint with an MTP head (fp32, CPU): exact against
decoding without speculation.

Random weights give an MTP head whose proposals are almost always rejected, so acceptance is set with
the benchmark-only draft sources: a recording of the plain run replayed (every proposal accepted),
shifted (every proposal rejected) or corrupted at chosen output positions (a rejection at every draft
position). Whatever the drafts, the tokens must be those of the plain run and the logprobs within
LOGPROB_TOL; the state after a rejection must not depend on the rejected tokens at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_oracle
import pytest
import torch
from safetensors.torch import save_file
from scheduler_harness import VOCAB, Run, load_model
from verify_offsets import first_differences

from deltaserve.cache.device import build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.engine.backend import Backend
from deltaserve.engine.sampler import Sampler, SamplingRow
from deltaserve.engine.step import PlannedRow, StepPlan
from deltaserve.engine_config import SpeculativeConfig
from deltaserve.errors import ConfigError
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny import random_text_weights

LOGPROB_TOL = 1e-4
PROMPTS = {
    "a": [11, 12, 13, 14, 15, 16, 17, 18, 19],
    "b": [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34],
    "c": [41, 42, 43],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    """HF's small random Qwen3.5 (text layout) plus a random MTP head under the official `mtp.*` names."""
    out = tmp_path_factory.mktemp("mtp_model")
    hf_oracle.save_text_layout(hf_oracle.build_hf_causal_lm(seed=5, layers=4, tied=True), out)
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    head = {
        k: v
        for k, v in random_text_weights(ModelConfig.from_dir(out), seed=6).items()
        if k.startswith("mtp.")
    }
    save_file(head, str(out / "mtp.safetensors"))
    return load_model(out, mtp=True)


def greedy(n: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2, **kw)


def spec(k: int, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, adaptive=False, **kw)


def serve(model, prompts, params, *, speculative=None, arrivals_after: int = 0, **run_kw) -> Run:
    """Runs the prompts to completion; the ones after the first `arrivals_after` arrive once the
    first ones are decoding."""
    run = Run(model, speculative=speculative, vocab_size=VOCAB, **run_kw)
    items = list(prompts.items())
    first = items[: arrivals_after or len(items)]
    for rid, prompt in first:
        run.add(rid, prompt, params)
    if arrivals_after:
        run.tick(4)
        for rid, prompt in items[arrivals_after:]:
            run.add(rid, prompt, params)
    run.run_until_idle()
    return run


def assert_same_outputs(got: Run, want: Run, rids) -> None:
    for rid in rids:
        assert got.tokens(rid) == want.tokens(rid), rid
        assert got.terminal(rid).finish_reason == want.terminal(rid).finish_reason
        for a, b in zip(got.logprobs(rid), want.logprobs(rid), strict=True):
            if a is None or b is None:
                assert a is b
                continue
            assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_TOL)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def record(model, tmp_path: Path, prompts, params, name: str = "rec.jsonl", **run_kw) -> tuple[Run, Path]:
    """A plain run, and the recording of a speculative run (the MTP head's drafts) that must equal it."""
    path = tmp_path / name
    cfg = spec(3, benchmark_draft="record", benchmark_draft_file=str(path))
    recorded = serve(model, prompts, params, speculative=cfg, **run_kw)
    plain = serve(model, prompts, params, **run_kw)
    assert_same_outputs(recorded, plain, prompts)
    return plain, path


def counters(run: Run):
    return run.sched.spec_counters


@pytest.mark.parametrize(
    ("k", "budget", "max_num_seqs", "arrivals"),
    [(3, 7, 3, 0), (1, 64, 1, 0), (2, 4096, 16, 1)],
)
def test_greedy_with_the_mtp_heads_drafts_equals_plain_decoding(model, k, budget, max_num_seqs, arrivals):
    kw = {"max_num_batched_tokens": budget, "max_num_seqs": max_num_seqs}
    plain = serve(model, PROMPTS, greedy(), arrivals_after=arrivals, **kw)
    fast = serve(model, PROMPTS, greedy(), speculative=spec(k), arrivals_after=arrivals, **kw)
    assert_same_outputs(fast, plain, PROMPTS)
    assert counters(fast).num_drafts > 0  # verify rows ran


def test_a_reduced_draft_vocabulary_proposes_only_its_ids_and_keeps_the_tokens(model, monkeypatch):
    # Drafting over the first 40 ids reads 40 LM-head rows per draft; verification over all of them
    # keeps every output token, whatever the drafts.
    plain = serve(model, PROMPTS, greedy())
    proposed: list[int] = []
    draft_tokens = type(model).draft_tokens

    def recording(self, hidden):
        tokens = draft_tokens(self, hidden)
        proposed.extend(tokens.tolist())
        return tokens

    monkeypatch.setattr(model, "draft_vocab_size", 40)
    monkeypatch.setattr(type(model), "draft_tokens", recording)
    fast = serve(model, PROMPTS, greedy(), speculative=spec(3))
    assert_same_outputs(fast, plain, PROMPTS)
    assert proposed and max(proposed) < 40
    assert max(t for rid in PROMPTS for t in plain.tokens(rid)) >= 40  # the targets reach beyond them


def test_a_draft_vocabulary_larger_than_the_tokenizers_is_refused(model):
    with pytest.raises(ConfigError, match="'draft_vocab_size' must be in 1..64 .*got 65"):
        Qwen35ForCausalLM(
            model.config,
            dtype=torch.float32,
            device=torch.device("meta"),
            logits_vocab_size=64,
            mtp=True,
            draft_vocab_size=65,
        )


@pytest.mark.parametrize("mode", ["replay", "wrong"])
def test_known_acceptance_keeps_the_tokens(model, tmp_path, mode):
    plain, path = record(model, tmp_path, PROMPTS, greedy(12))
    assert len(path.read_text().splitlines()) == len(PROMPTS)
    cfg = spec(3, benchmark_draft=mode, benchmark_draft_file=str(path))
    fast = serve(model, PROMPTS, greedy(12), speculative=cfg, max_num_batched_tokens=16)
    assert_same_outputs(fast, plain, PROMPTS)
    c = counters(fast)
    assert c.num_draft_tokens > 0
    if mode == "replay":
        assert c.num_accepted_tokens == c.num_draft_tokens
        assert c.mean_acceptance_length > 3.0  # most rows verify 3 drafts; the last ones fewer
    else:
        assert c.num_accepted_tokens == 0


def test_forced_acceptance_emits_the_proposals_and_the_targets_token_after_them(model):
    """Benchmark-only "accept": every step accepts its 3 proposals and emits the target's token after
    them, so output tokens 0, 4, 8, 12 are the target's greedy tokens after what came before (the
    state and KV of the forced tokens were committed with them), whatever the proposals were."""
    fast = serve(model, PROMPTS, greedy(13), speculative=spec(3, benchmark_draft="accept"))
    c = counters(fast)
    assert c.num_accepted_tokens == c.num_draft_tokens > 0
    outputs = {rid: fast.tokens(rid) for rid in PROMPTS}
    assert all(len(out) == 13 for out in outputs.values())
    probes = {f"{rid}@{i}": PROMPTS[rid] + out[:i] for rid, out in outputs.items() for i in (0, 4, 8, 12)}
    plain = serve(model, probes, greedy(1))
    for name in probes:
        rid, i = name.split("@")
        assert plain.tokens(name) == [outputs[rid][int(i)]], name


def _spy_plans(monkeypatch) -> list[StepPlan]:
    plans: list[StepPlan] = []
    launch = Backend.launch

    def spy(self, plan):
        plans.append(plan)
        return launch(self, plan)

    monkeypatch.setattr(Backend, "launch", spy)
    return plans


def test_a_step_with_prompt_chunks_verifies_nothing_but_its_decoders_still_draft(model, monkeypatch):
    """Verify rows run eager (no prefill graph holds them), so beside a prompt chunk the decoders only
    draft: the step goes through a prefill graph on the GPU, and they verify again in the next step."""
    plans = _spy_plans(monkeypatch)
    fast = serve(model, PROMPTS, greedy(12), speculative=spec(3), arrivals_after=1)
    monkeypatch.undo()
    assert_same_outputs(fast, serve(model, PROMPTS, greedy(12), arrivals_after=1), PROMPTS)
    beside = [p for p in plans if p.prefill and p.decode]
    assert beside, "the later prompts arrived while the first one decoded"
    for plan in beside:
        assert plan.num_drafts == 3 and not any(r.is_verify for r in plan.decode)
        assert all(r.drafts for r in plan.decode)
    assert any(r.is_verify for p in plans for r in p.decode)


@pytest.mark.parametrize("phase", [1, 2, 3])
def test_a_rejection_at_every_draft_position_keeps_the_tokens(model, tmp_path, phase):
    plain, path = record(model, tmp_path, PROMPTS, greedy(14))
    lines = []
    for line in path.read_text().splitlines():
        item = json.loads(line)
        out = item["output_token_ids"]
        item["output_token_ids"] = [(t + 1) if i % 4 == phase else t for i, t in enumerate(out)]
        lines.append(json.dumps(item))
    path.write_text("\n".join(lines) + "\n")
    cfg = spec(3, benchmark_draft="replay", benchmark_draft_file=str(path))
    fast = serve(model, PROMPTS, greedy(14), speculative=cfg)
    assert_same_outputs(fast, plain, PROMPTS)
    c = counters(fast)
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens


def test_seeded_sampling_with_speculation_draws_the_same_tokens(model, tmp_path):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=10, ignore_eos=True, logprobs=1),
        SamplingParams(
            temperature=0.7,
            seed=99,
            max_tokens=10,
            ignore_eos=True,
            repetition_penalty=1.3,
            presence_penalty=1.5,
            frequency_penalty=0.5,
        ),
    ]
    prompts = list(PROMPTS.items())

    def run_all(speculative):
        run = Run(model, speculative=speculative, vocab_size=VOCAB)
        for (rid, prompt), p in zip(prompts, params, strict=True):
            run.add(rid, prompt, p)
        run.run_until_idle()
        return run

    path = tmp_path / "sampled.jsonl"
    plain = run_all(None)
    record = spec(3, benchmark_draft="record", benchmark_draft_file=str(path))
    for cfg in (record, spec(3, benchmark_draft="replay", benchmark_draft_file=str(path))):
        fast = run_all(cfg)
        for rid, _ in prompts:
            assert fast.tokens(rid) == plain.tokens(rid), rid
    assert counters(fast).num_accepted_tokens == counters(fast).num_draft_tokens > 0


def test_the_verified_position_draws_from_the_target_distribution():
    """The rule behind the exactness: at a verified position the emitted token is the target's own draw
    (the sampler at that output index), so over seeds it follows the target's distribution, and the
    draft is accepted with the target's probability of it."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log()[None].repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, seed, 1, [1], [2]) for seed in range(4000)]
    drawn = Sampler()(logits, rows).token_ids
    freq = torch.bincount(drawn, minlength=4).float() / len(rows)
    chi2 = float((((freq - probs) ** 2) / probs).sum() * len(rows))
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom
    draft = 1
    assert float((drawn == draft).float().mean()) == pytest.approx(0.25, abs=0.025)


def test_the_committed_state_does_not_depend_on_the_rejected_drafts(model):
    """Two verify rows over the same context, the same accepted draft and different rejected tails:
    the slot's conv and SSM state after the step are bit-identical, and within fp32 rounding of plain
    decoding over the accepted tokens."""
    caches = build_device_caches(
        model.config,
        num_pages=16,
        page_size=4,
        num_slots=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_kv_layers=model.num_kv_layers,
    )
    backend = Backend(model, caches)
    prompt = [5, 6, 7, 8, 9, 10]
    pages = [1, 2, 3, 4]

    def prefill(slot: int) -> int:
        row = PlannedRow(prompt, 0, pages, slot, SamplingRow(greedy(), 0, 0, prompt, []))
        return backend.launch(StepPlan(prefill=[row])).wait().token_ids[0]

    def state(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return caches.states.conv[:, slot].clone(), caches.states.ssm[:, slot].clone()

    first = prefill(1)
    # Greedy target after [prompt, first]: find it with a plain decode on slot 2.
    prefill(2)
    plain_row = PlannedRow([first], len(prompt), pages, 2, SamplingRow(greedy(), 0, 1, prompt, [first]))
    second = backend.launch(StepPlan(decode=[plain_row])).wait().token_ids[0]
    plain = state(2)

    results = []
    for tail in ([3, 4], [100, 200]):
        prefill(1)
        tokens = [first, second, *tail]  # draft `second` is right; the tail is rejected
        row = PlannedRow(
            tokens,
            len(prompt),
            pages,
            1,
            SamplingRow(greedy(), 0, 1, prompt, [first]),
            state_after=[5, 6, 7],
            draft_sampling=[
                SamplingRow(greedy(), 0, 1 + j, prompt, [first, *tokens[1 : j + 1]]) for j in range(1, 4)
            ],
        )
        result = backend.launch(StepPlan(decode=[row], num_drafts=1)).wait()
        emitted = result.speculation.emitted[0]
        assert emitted[0] == second and len(emitted) in (2, 3)  # `second` accepted, the tail not
        if len(emitted) == 3:
            pytest.skip("the random tiny model happened to predict the first tail token")
        results.append(state(1))
    (conv_a, ssm_a), (conv_b, ssm_b) = results
    assert torch.equal(conv_a, conv_b) and torch.equal(ssm_a, ssm_b)
    # Plain decoding advanced slot 2 by `first` only; the verify row committed `first` and `second`.
    plain_row2 = PlannedRow(
        [second], len(prompt) + 1, pages, 2, SamplingRow(greedy(), 0, 2, prompt, [first, second])
    )
    backend.launch(StepPlan(decode=[plain_row2])).wait()
    conv_p, ssm_p = state(2)
    assert torch.allclose(conv_a, conv_p, atol=1e-5) and torch.allclose(ssm_a, ssm_p, atol=1e-5)
    assert plain[0].shape == conv_p.shape


def test_prefix_cache_hits_with_speculation_equal_plain_without_the_cache(model, tmp_path):
    """A conversation's second turn resumes from the cache with speculation on (replayed drafts, all
    accepted): its tokens are those of a cache-off, speculation-off run."""
    params = greedy(8)
    turn1 = {"t1": PROMPTS["b"]}
    plain1, path = record(model, tmp_path, turn1, params, num_snapshots=0)
    turn2_prompt = PROMPTS["b"] + plain1.tokens("t1") + [50, 51, 52, 53, 54]
    plain = serve(model, {"t2": turn2_prompt}, params)
    cfg = spec(3, benchmark_draft="replay", benchmark_draft_file=str(path))
    run = Run(model, speculative=cfg, vocab_size=VOCAB, num_snapshots=32)
    run.add("t1", PROMPTS["b"], params)
    run.run_until_idle()
    run.add("t2", turn2_prompt, params)
    run.run_until_idle()
    assert run.tokens("t1") == plain1.tokens("t1")
    assert run.terminal("t2").num_cached_tokens > len(PROMPTS["b"])
    assert_same_outputs(run, plain, ["t2"])


def test_a_stop_inside_an_accepted_run_caches_no_state_of_a_later_position(model, tmp_path):
    """A request whose stop token is an accepted draft ends there while its slot holds the state after
    the whole accepted run: no snapshot may claim that state for the stop position. A continuation
    from the stop must equal a cache-off run."""
    params = greedy(12)
    rec, path = record(model, tmp_path, {"a": PROMPTS["a"]}, params)
    out = rec.tokens("a")
    # The first verify row emits outputs 1..4 (three accepted drafts and the target's next token);
    # output 2 is inside that run.
    stop = out[2]
    if stop in out[:2]:
        pytest.skip("the stop token occurs earlier in this output")
    stopped = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    cfg = spec(3, benchmark_draft="replay", benchmark_draft_file=str(path))
    run = Run(model, speculative=cfg, vocab_size=VOCAB, num_snapshots=32)
    run.add("a", PROMPTS["a"], stopped)
    run.run_until_idle()
    assert run.tokens("a") == out[:3] and run.terminal("a").finish_reason == "stop"
    follow = PROMPTS["a"] + out[:3] + [60, 61]
    run.add("f", follow, greedy(6))
    run.run_until_idle()
    plain = serve(model, {"f": follow}, greedy(6))
    assert_same_outputs(run, plain, ["f"])


def test_a_position_computes_the_same_bits_at_any_offset_of_its_verify_row(model):
    """What a replayed recording of the speculative path needs (tests/verify_offsets.py)."""
    caches = build_device_caches(
        model.config,
        num_pages=32,
        page_size=16,
        num_slots=12,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_kv_layers=model.num_kv_layers,
    )
    assert first_differences(model, caches, list(range(30, 60))) == []


def test_kv_pressure_with_speculation_preempts_and_still_gives_the_plain_tokens(model):
    """Verify rows and their lookahead pages under a pool too small for every request at once: the
    lookahead is skipped or the newest request preempted, never a wrong token."""
    # Optimistic admission (a reserve of 1 token): growth preempts.
    kw = {"num_pages": 14, "page_size": 4, "max_num_batched_tokens": 16, "kv_reserve_tokens": 1}
    plain = serve(model, PROMPTS, greedy(16), **kw)
    fast = serve(model, PROMPTS, greedy(16), speculative=spec(3), **kw)
    assert_same_outputs(fast, plain, PROMPTS)
    assert fast.sched.num_preemptions > 0 or plain.sched.num_preemptions > 0


def _drafting_rows(plans: list[StepPlan]) -> int:
    return sum(1 for p in plans for r in p.rows if r.drafts or r.is_verify)


def test_a_request_a_plain_step_advanced_never_drafts_again(model, monkeypatch):
    """With two decoders and max_batch 1 the guard runs plain steps, which write no MTP K/V: once the
    short request ends, the long one decodes alone (the guard would draft) but never drafts: its
    steps are plain ones, launched ahead. A request arriving after that drafts from its prompt on.
    The tokens stay those of plain decoding."""
    plans = _spy_plans(monkeypatch)
    cfg = SpeculativeConfig(num_speculative_tokens=3, max_batch=1)
    run = Run(model, speculative=cfg, vocab_size=VOCAB)
    run.add("a", PROMPTS["a"], greedy(3))
    run.add("b", PROMPTS["b"], greedy(14))
    while not run.terminals("a"):
        run.tick()
    alone = len(plans)
    while not run.terminals("b"):
        run.tick()
    b_alone = plans[alone:]
    assert b_alone and all(len(p.rows) == 1 for p in b_alone)
    assert all(p.num_drafts == 0 for p in b_alone) and _drafting_rows(b_alone) == 0
    assert any(p.feed is not None for p in b_alone), "plain steps are launched ahead again"
    later = len(plans)
    run.add("c", PROMPTS["c"], greedy(8))
    run.run_until_idle()
    assert _drafting_rows(plans[later:]) > 0
    monkeypatch.undo()
    plain = Run(model, vocab_size=VOCAB)
    for rid, params in (("a", greedy(3)), ("b", greedy(14)), ("c", greedy(8))):
        plain.add(rid, PROMPTS[rid], params)
    plain.run_until_idle()
    assert_same_outputs(run, plain, ["a", "b", "c"])


@pytest.mark.parametrize("gaps", [False, True])
def test_a_prefix_cache_hit_on_positions_without_mtp_kv_does_not_draft(model, monkeypatch, gaps):
    """Turn 1 decodes beside another request (plain steps under max_batch 1: its decode pages lack MTP
    K/V) or alone (every step speculative); turn 2 resumes from turn 1's pages and drafts only when
    they hold the MTP head's K/V."""
    params = greedy(8)
    cfg = SpeculativeConfig(num_speculative_tokens=3, max_batch=1)
    run = Run(model, speculative=cfg, vocab_size=VOCAB, num_snapshots=32)
    run.add("t1", PROMPTS["b"], params)
    if gaps:
        run.add("other", PROMPTS["c"], greedy(20))
    run.run_until_idle()
    turn2 = PROMPTS["b"] + run.tokens("t1") + [50, 51, 52, 53, 54]
    plans = _spy_plans(monkeypatch)
    run.add("t2", turn2, params)
    run.run_until_idle()
    assert run.terminal("t2").num_cached_tokens > len(PROMPTS["b"])
    assert (_drafting_rows(plans) == 0) == gaps
    monkeypatch.undo()
    assert_same_outputs(run, serve(model, {"t2": turn2}, params), ["t2"])


def test_penalised_requests_with_speculation_keep_the_plain_tokens(model, tmp_path):
    """A verify position's penalties count the drafts before it (on top of its slot's device counts):
    with every draft accepted (replayed), the tokens of plain decoding."""
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=2.0, repetition_penalty=1.5
    )

    def run_all(speculative):
        run = Run(model, speculative=speculative, vocab_size=VOCAB)
        for rid, prompt in PROMPTS.items():
            run.add(rid, prompt, params)
        run.run_until_idle()
        return run

    path = tmp_path / "penalised.jsonl"
    plain = run_all(None)
    run_all(spec(3, benchmark_draft="record", benchmark_draft_file=str(path)))
    fast = run_all(spec(3, benchmark_draft="replay", benchmark_draft_file=str(path)))
    for rid in PROMPTS:
        assert fast.tokens(rid) == plain.tokens(rid), rid
    assert counters(fast).num_accepted_tokens == counters(fast).num_draft_tokens > 0
