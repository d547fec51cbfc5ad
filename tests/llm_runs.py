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
