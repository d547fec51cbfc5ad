"""Prompt logprobs: the engine scores every prompt token (against HF transformers), under any chunking,
next to requests that do not ask, once per request even when preempted mid-prefill."""

from __future__ import annotations

import random
from pathlib import Path

import hf_oracle
import pytest
import torch
from scheduler_harness import VOCAB, Run, load_model

from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.engine.scheduler import steps
from deltaserve.sampling_params import SamplingParams

PROMPT = [random.Random(3).randrange(VOCAB) for _ in range(60)]


@pytest.fixture(scope="module")
def hf():
    return hf_oracle.build_hf_causal_lm(seed=11, layers=4, tied=True).float().eval()


@pytest.fixture(scope="module")
def model(hf, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("plp_model")
    hf_oracle.save_text_layout(hf, out)
    return load_model(Path(out))


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def scored_prompt(run: Run, rid: str) -> list[TokenLogprobs | None]:
    carrying = [u for u in run.updates[rid] if u.prompt_logprobs is not None]
    assert len(carrying) == 1, f"{rid}: prompt logprobs sent {len(carrying)} times"
    assert carrying[0].new_token_ids, "they travel with the first token"
    return carrying[0].prompt_logprobs


def check_against_hf(
    scored: list[TokenLogprobs | None], prompt: list[int], want: torch.Tensor, k: int
) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        got, dist = scored[i], want[i - 1]
        assert abs(got.logprob - float(dist[prompt[i]])) < 1e-3, i
        assert got.rank == int((dist > dist[prompt[i]]).sum()) + 1, i
        assert [t for t, _ in got.top] == dist.topk(k).indices.tolist(), i


@pytest.mark.parametrize("budget", [1, 7, 64, 4096])
def test_prompt_logprobs_equal_hf_at_any_chunking_beside_other_requests(hf, model, budget) -> None:
    other = [random.Random(4).randrange(VOCAB) for _ in range(33)]
    run = Run(model, max_num_batched_tokens=budget)
    run.add("scored", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3))
    run.add("plain", other, SamplingParams(temperature=0.0, max_tokens=6))
    run.add("also", other, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    run.run_until_idle()
    check_against_hf(scored_prompt(run, "scored"), PROMPT, hf_logprobs(hf, PROMPT), 3)
    check_against_hf(scored_prompt(run, "also"), other, hf_logprobs(hf, other), 0)
    assert all(u.prompt_logprobs is None for u in run.updates["plain"])
    alone = Run(model)
    alone.add("plain", other, SamplingParams(temperature=0.0, max_tokens=6))
    alone.run_until_idle()
    assert run.tokens("plain") == alone.tokens("plain")


def test_a_one_token_prompt_has_nothing_to_score(model) -> None:
    run = Run(model)
    run.add("one", [7], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    run.run_until_idle()
    assert scored_prompt(run, "one") == [None]


def test_a_request_preempted_mid_prefill_scores_its_prompt_once(hf, model) -> None:
    run = Run(model, max_num_batched_tokens=8)
    run.add("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1))
    run.tick(3)  # three 8-token chunks scored
    req = run.sched.by_id["r"]
    assert 0 < req.num_computed < len(PROMPT) and len(req.prompt_logprobs) == req.num_computed + 1
    steps.preempt(run.sched, req)
    run.run_until_idle()
    assert req.num_preemptions == 1
    check_against_hf(scored_prompt(run, "r"), PROMPT, hf_logprobs(hf, PROMPT), 1)
