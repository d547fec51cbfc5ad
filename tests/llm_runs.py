"""One offline LLM run for tests that compare two engine configurations token for token."""

from __future__ import annotations

import gc
from typing import Any

import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams


def release_gpu_memory() -> None:
    """Returns a shut-down engine's GPU memory to the device, so that the next engine in this process
    sees it free (the engine's objects hold reference cycles; the allocator keeps freed blocks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate_token_ids(
    model: str, prompts: list[dict[str, Any]], params: list[SamplingParams], **engine_args: Any
) -> list[list[int]]:
    """Each request's token ids from an LLM with `engine_args`; the engine's GPU memory is returned
    before the next run, and no request may fail."""
    with LLM(model, **engine_args) as llm:
        outs = llm.generate(prompts, params)
    del llm
    release_gpu_memory()
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]
