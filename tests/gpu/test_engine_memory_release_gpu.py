"""A second engine of one process sizes its KV pool after the first is shut down and dropped: the
first's weights, pages and graphs, cached by the allocator or waiting in reference cycles, are given
back to the driver before the second reads the free memory (each takes --gpu-memory-utilization of the
GPU, so without that the second finds its share in use)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 256}


def test_a_second_engine_gets_the_memory_of_the_first_it_follows():
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = LLM(None, **ENGINE)
    first_pages = first.engine.info.kv_pages
    (want,) = first.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    first.shutdown()
    del first
    with LLM(None, **ENGINE) as second:
        assert second.engine.info.kv_pages >= 0.95 * first_pages, (second.engine.info.kv_pages, first_pages)
        (got,) = second.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
