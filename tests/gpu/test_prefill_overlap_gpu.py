"""Prefill overlap on the GPU: async prefill chunks on their own stream beside the decode graphs on
the main one give the tokens of the same engine without overlap (tiny model, fp32, prefill graphs in
a pool of their own, the prefix cache on: shared prefixes restore snapshots an async chunk wrote)."""

from __future__ import annotations

import random

import pytest
from llm_runs import generate_token_ids

from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny import default_model_dir


def _prompts() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(1000, 200_000) for _ in range(150)]
    prompts = []
    for n in (3, 700, 40, 1, 260, 90, 513, 7, 1200, 33):
        own = [rng.randrange(1000, 200_000) for _ in range(n)]
        prompts.append(own if n % 2 else shared + own)  # the even ones share a 150-token prefix
    return [{"prompt_token_ids": p} for p in prompts]


def _generate(overlap: bool) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in (60, 5, 40, 80, 3, 30, 12, 70, 9, 25)
    ]
    return generate_token_ids(
        str(default_model_dir()),
        _prompts(),
        params,
        dtype="float32",
        max_num_seqs=8,
        max_model_len=4096,
        max_num_batched_tokens=128,
        prefill_overlap=overlap,
    )


@pytest.mark.parametrize("repeat", range(2))
def test_prefill_overlap_gives_the_tokens_of_the_synchronous_engine(repeat: int) -> None:
    overlapped = _generate(overlap=True)
    assert [len(t) for t in overlapped] == [60, 5, 40, 80, 3, 30, 12, 70, 9, 25]
    assert overlapped == _generate(overlap=False)
