"""Decode-ahead on the GPU: the same tokens as reading every step, through CUDA graphs and the device
token feed (0.8B shape, dummy weights, seeded identically for both engines)."""

from __future__ import annotations

import random

import pytest
from llm_runs import generate_token_ids

from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny import make_tiny


def _generate(model_dir: str, decode_ahead: bool) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 200_000) for _ in range(n)]} for n in (1, 9, 40, 130, 3, 77)
    ]
    # Length stops only: both modes then run the same batches step for step, so every token, sampled
    # ones included, must agree exactly (a stop token would add a dropped row to one mode's batches).
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 5, 24, 40, 2, 33)]
    params[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=-3, max_tokens=40, ignore_eos=True)
    params[5] = SamplingParams(temperature=0.0, max_tokens=33, logprobs=2, ignore_eos=True)
    return generate_token_ids(
        model_dir,
        prompts,
        params,
        load_format="dummy",
        max_num_seqs=8,
        max_model_len=2048,
        max_num_batched_tokens=256,
        decode_ahead=decode_ahead,
    )


def test_decode_ahead_gives_the_same_tokens_on_the_gpu(tmp_path: pytest.TempPathFactory) -> None:
    model_dir = str(make_tiny(tmp_path / "m08", "0.8b-shape", weights=False))
    synchronous = _generate(model_dir, decode_ahead=False)
    ahead = _generate(model_dir, decode_ahead=True)
    assert [len(t) for t in ahead] == [1, 5, 24, 40, 2, 33]
    assert ahead == synchronous
