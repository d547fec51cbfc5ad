"""One offline LLM run for tests that compare two engine configurations token for token."""

from __future__ import annotations

from typing import Any

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams


def generate_token_ids(
    model: str, prompts: list[dict[str, Any]], params: list[SamplingParams], **engine_args: Any
) -> list[list[int]]:
    """Each request's token ids from an LLM with `engine_args` (the next engine of the process gets its
    GPU memory back: engine/rank.py, release_unreferenced_device_memory); no request may fail."""
    with LLM(model, **engine_args) as llm:
        outs = llm.generate(prompts, params)
    del llm
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def tiny_greedy_runs() -> list[tuple[list[int], list[float]]]:
    """Token ids and their log-probs of one request, then of five together, greedy through the tiny
    default model in bf16: the same for two settings of a switch that must change no value."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(5)]
    with LLM(None, dtype="bfloat16", max_num_seqs=8, max_model_len=256) as llm:
        one = llm.generate(prompts[:1], params)
        many = llm.generate(prompts, params)
    return [(list(r.outputs[0].token_ids), [lp.logprob for lp in r.outputs[0].logprobs]) for r in one + many]
