"""MTP speculative decoding on the GPU under CUDA graphs (fp32): greedy outputs with speculation equal the
outputs without, with the MTP head's own drafts and at known acceptance (its recording replayed, or
every proposal wrong, which makes the guard step down through every draft count); forced acceptance
accepts every proposal."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23, 24, 25], [41, 42, 43, 44, 45, 46, 47]]


def generate(speculative_config=None):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 512, "max_num_batched_tokens": 256}
    with LLM(None, speculative_config=speculative_config, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        load = llm.engine.scheduler.load
    return [o.outputs[0].token_ids for o in outs], load


def test_speculation_under_graphs_equals_plain_decoding(tmp_path):
    plain, _ = generate()
    path = str(tmp_path / "rec.jsonl")
    base = {"num_speculative_tokens": 3, "benchmark_draft_file": path}
    recorded, load = generate({**base, "benchmark_draft": "record"})
    assert recorded == plain
    assert load.spec_num_drafts > 0
    replayed, load = generate({**base, "benchmark_draft": "replay"})
    assert replayed == plain
    assert load.spec_num_accepted_tokens == load.spec_num_draft_tokens > 0
    wrong, load = generate({**base, "benchmark_draft": "wrong"})
    assert wrong == plain
    assert load.spec_num_accepted_tokens == 0 < load.spec_num_draft_tokens
    forced, load = generate({"num_speculative_tokens": 3, "benchmark_draft": "accept"})
    assert [len(t) for t in forced] == [len(t) for t in plain]
    assert load.spec_num_accepted_tokens == load.spec_num_draft_tokens > 0


def test_a_reduced_draft_vocabulary_under_graphs_keeps_the_tokens():
    # The draft and greedy-chain graphs read 1,024 LM-head rows per draft instead of the vocabulary.
    plain, _ = generate()
    reduced, load = generate({"num_speculative_tokens": 3, "draft_vocab_size": 1024})
    assert reduced == plain
    assert load.spec_num_drafts > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_position_computes_the_same_bits_at_any_offset_of_its_verify_row(tmp_path, dtype):
    """What replaying a recording of the speculative path needs: the first differing op is named
    (tests/verify_offsets.py). Random weights at the 0.8B shape."""
    from verify_offsets import first_differences

    from deltaserve.cache.device import build_device_caches
    from deltaserve.config import ModelConfig
    from deltaserve.model.qwen35 import Qwen35ForCausalLM
    from deltaserve.model.weights import init_dummy_weights
    from deltaserve.tiny import make_tiny

    cfg = ModelConfig.from_dir(make_tiny(tmp_path / "m", "0.8b-shape", weights=False))
    device = torch.device("cuda")
    model = Qwen35ForCausalLM(cfg, dtype=dtype, device=device, mtp=True)
    init_dummy_weights(model)
    caches = build_device_caches(
        cfg,
        num_pages=32,
        page_size=16,
        num_slots=12,
        dtype=dtype,
        device=device,
        num_kv_layers=model.num_kv_layers,
    )
    assert first_differences(model, caches, list(range(1000, 1100))) == []
