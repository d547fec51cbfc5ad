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


def test_the_mtp_pass_over_one_token_rows_and_drafts_after_it_replay_what_eager_computes(tmp_path):
    """A step a prefill graph ran (1-token prompts, decoders without proposals) takes its MTP pass from
    the one-token graph and its chained drafts from the draft graphs, over block tables loaded for the
    drafting rows (here in another order than the pass's rows, so stale tables would show)."""
    from deltaserve.cache.device import build_device_caches
    from deltaserve.config import ModelConfig
    from deltaserve.engine.spec_graphs import SpeculativeGraphs
    from deltaserve.model.qwen35 import Qwen35ForCausalLM
    from deltaserve.model.weights import init_dummy_weights
    from deltaserve.ops.batch import BatchRow, build_forward_batch
    from deltaserve.tiny import make_tiny

    cfg = ModelConfig.from_dir(make_tiny(tmp_path / "m", "tiny", weights=False))
    device, page = torch.device("cuda"), 16
    model = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=device, mtp=True)
    init_dummy_weights(model)
    caches = build_device_caches(
        cfg,
        num_pages=64,
        page_size=page,
        num_slots=12,
        dtype=torch.float32,
        device=device,
        num_kv_layers=model.num_kv_layers,
    )
    graphs = SpeculativeGraphs(model, caches, max_rows=4, max_drafts=3, max_model_len=256)
    graphs.capture()
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths, pages = [20, 5, 33], [[1, 2], [3], [4, 5, 6]]
    prompts = [
        BatchRow(torch.randint(0, 1000, (n,), generator=gen).tolist(), 0, p, i + 1)
        for i, (n, p) in enumerate(zip(lengths, pages, strict=True))
    ]
    with torch.inference_mode():
        batch = build_forward_batch(prompts, page, device)
        hidden = model(batch, caches.kv, caches.states, every_token=True)
        ids = torch.randint(0, 1000, (sum(lengths),), generator=gen).to(device)
        model.mtp_forward(ids, hidden, batch, caches.kv)  # the prompts' MTP K/V

        rows = [BatchRow([7 + i], n, p, i + 1) for i, (n, p) in enumerate(zip(lengths, pages, strict=True))]
        rows.append(BatchRow([10], 0, [7], 4))  # a 1-token prompt
        ids = torch.tensor([11, 12, 13, 14], device=device)
        target_hidden = torch.randn(4, cfg.hidden_size, generator=gen).to(device)
        want = model.mtp_forward(ids, target_hidden, build_forward_batch(rows, page, device), caches.kv)
        got = graphs.mtp_single(rows, ids, target_hidden)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

        order = [2, 3, 0, 1]
        drafting = [rows[i] for i in order]
        tokens = model.draft_tokens(want[order])
        positions = [r.context_len + 1 for r in drafting]
        step = [BatchRow([0], pos, r.pages, 0) for r, pos in zip(drafting, positions, strict=True)]
        want_hidden = model.mtp_forward(
            tokens, want[order], build_forward_batch(step, page, device), caches.kv
        )
        graphs.load_tables(drafting)
        got_hidden, got_tokens = graphs.draft(drafting, tokens, want[order], positions)
        torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-4, atol=1e-4)
        assert got_tokens.tolist() == model.draft_tokens(want_hidden).tolist()
