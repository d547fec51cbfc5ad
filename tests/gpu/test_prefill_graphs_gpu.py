"""Prefill graphs against the eager forward on the GPU (tiny model, fp32): logits, the live caches,
nothing else touched but the reserved page and slot; replays of one bucket with new rows; the device
token feed of decode rows; a unified step whole in a prefill graph beside the decode graphs; a capture
that fails leaves its bucket eager; captures ahead of need (last: they capture every likely bucket)."""

from __future__ import annotations

import pytest
import torch
from scheduler_harness import load_model

from deltaserve.cache.device import build_device_caches
from deltaserve.cache.kv_pages import DUMMY_PAGE
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.engine.cuda_graphs import CudaGraphRunner
from deltaserve.engine.prefill_graphs import PrefillGraphRunner, ahead_of_need
from deltaserve.engine.worker import ModelWorker
from deltaserve.ops.batch import BatchRow, build_forward_batch
from deltaserve.tiny import default_model_dir

DEVICE = torch.device("cuda")
PAGE = 16
NUM_PAGES, NUM_SLOTS = 48, 9


@pytest.fixture(scope="module")
def setup():
    model = load_model(default_model_dir(), device=DEVICE)
    caches = build_device_caches(
        model.config,
        num_pages=NUM_PAGES,
        page_size=PAGE,
        num_slots=NUM_SLOTS,
        dtype=torch.float32,
        device=DEVICE,
    )
    decode = CudaGraphRunner(model, caches, max_num_seqs=8, max_model_len=512)
    decode.capture()
    prefill = PrefillGraphRunner(model, caches, 8, 256, 512, pool=decode.pool)
    pools = (caches.kv.k, caches.kv.v, caches.states.conv, caches.states.ssm)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for t in pools:  # idle pages and slots hold values a stray write would change
        t.normal_(generator=gen)
    eager = ModelWorker(model, caches)
    # Context: 40 tokens in slot 1 (pages 1-3), 100 in slot 2 (pages 4-10).
    eager.run(
        [BatchRow(list(range(40)), 0, [1, 2, 3], 1), BatchRow(list(range(100, 200)), 0, range(4, 11), 2)]
    )
    both = ModelWorker(model, caches, decode, prefill)  # pure decode steps in the decode graphs
    return eager, ModelWorker(model, caches, prefill_graphs=prefill), prefill, pools, both


def compare(setup, rows: list[BatchRow], fed: torch.Tensor | None = None, both: bool = False) -> None:
    """The replay against (1) the same padded batch launched eagerly: the same kernels on the same
    inputs, so the same logits and caches; (2) the ordinary eager forward of the rows, whose decode rows
    take the decode attention programs where the graph runs them as one-token sequences (the GDN decode
    kernel in both): the same greedy tokens, the top-8 log-probs within 5e-2. The caches go on from (2).
    With `both`, through a worker that also has the decode graphs."""
    eager, graphed, prefill, pools, both_worker = setup
    if both:
        graphed = both_worker
    before = [t.clone() for t in pools]

    def restore(state: list[torch.Tensor]) -> None:
        for dst, src in zip(pools, state, strict=True):
            dst.copy_(src)

    padded = prefill.run_eager(rows, fed)
    after_padded = [t.clone() for t in pools]
    restore(before)
    assert prefill.can_run(rows)
    got, _ = graphed.run(rows, fed)
    after_graph = [t.clone() for t in pools]
    restore(before)
    want, _ = eager.run(rows, fed)
    torch.testing.assert_close(got, padded, atol=1e-5, rtol=1e-5)
    # Not the reserved page and slot: padding tokens hold whatever their garbage rows compute.
    real = (
        [p for p in range(NUM_PAGES) if p != DUMMY_PAGE],
        [s for s in range(NUM_SLOTS) if s != DUMMY_SLOT],
    )
    for i, (g, p) in enumerate(zip(after_graph, after_padded, strict=True)):
        kept = real[i // 2]  # k, v by page; conv, ssm by slot
        torch.testing.assert_close(g[:, kept], p[:, kept], atol=1e-5, rtol=1e-5)
    got_lp, want_lp = got.log_softmax(-1), want.log_softmax(-1)
    assert torch.equal(got_lp.argmax(-1), want_lp.argmax(-1))
    top = want_lp.topk(8, dim=-1).indices
    assert float((got_lp.gather(1, top) - want_lp.gather(1, top)).abs().max()) <= 5e-2
    live_pages = sorted({p for r in rows for p in r.pages})
    live_slots = sorted({r.state_slot for r in rows})
    others = [p for p in range(NUM_PAGES) if p not in live_pages and p != DUMMY_PAGE]
    idle = [s for s in range(NUM_SLOTS) if s not in live_slots and s != DUMMY_SLOT]
    k_g, v_g, conv_g, ssm_g = after_graph
    k0, v0, conv0, ssm0 = before
    assert torch.equal(k_g[:, others], k0[:, others]) and torch.equal(v_g[:, others], v0[:, others])
    assert torch.equal(conv_g[:, idle], conv0[:, idle]) and torch.equal(ssm_g[:, idle], ssm0[:, idle])


def test_a_mixed_step_equals_eager(setup):
    rows = [
        BatchRow([7], 40, [1, 2, 3], 1),  # decode row
        BatchRow(list(range(300, 303)), 100, range(4, 11), 2),  # chunk with context
        BatchRow(list(range(500, 570)), 0, [11, 12, 13, 14, 15], 3),  # 70-token prompt: two fla chunks
        BatchRow(list(range(600, 630)), 0, [16, 17], 4, need_logits=False),  # a longer prompt's first chunk
    ]
    compare(setup, rows)


def test_replays_of_one_bucket_with_new_rows_and_a_smaller_bucket(setup):
    # The 128-token x 4-row bucket again (captured above), with other lengths, slots and pages.
    rows = [
        BatchRow(list(range(50, 150)), 0, range(20, 27), 5),
        BatchRow([3, 4], 0, [27], 6),
        BatchRow([9], 103, range(4, 11), 2),  # slot 2 holds 103 tokens now
    ]
    compare(setup, rows)
    compare(setup, [BatchRow(list(range(9, 20)), 0, [28], 7)])  # 16 tokens x 1 row


def test_decode_rows_take_the_fed_tokens(setup):
    fed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    rows = [BatchRow([0], 41, [1, 2, 3], 1), BatchRow(list(range(700, 720)), 0, [29, 30], 8)]
    compare(setup, rows, fed)


def test_a_unified_step_replays_whole_in_a_prefill_graph_beside_the_decode_graphs(setup):
    # Slot 1 holds 42 tokens and slot 2 104 after the tests above; the fed token replaces row 0's.
    fed = torch.tensor([77], dtype=torch.int64, device=DEVICE)
    rows = [
        BatchRow([0], 42, [1, 2, 3], 1),
        BatchRow([5], 104, range(4, 11), 2),
        BatchRow(list(range(800, 870)), 0, [32, 33, 34, 35, 36], 6),
    ]
    compare(setup, rows, fed, both=True)


def test_every_token_graphs_return_the_eager_forwards_hidden_states_and_the_same_logits(setup):
    """Speculative decoding's prefill graphs keep every token's hidden state (the MTP head reads it):
    the replay equals the eager forward's `every_token` output, and its logits those of the rows-only
    graphs over the same rows."""
    eager, _, prefill, pools, _ = setup
    model, caches = prefill.model, prefill.cache
    every = PrefillGraphRunner(model, caches, 8, 256, 512, pool=prefill.pool, every_token=True)
    rows = [
        BatchRow([3], 43, [1, 2, 3], 1),  # decode row (slot 1 holds 43 tokens after the tests above)
        BatchRow(list(range(900, 970)), 0, [45, 46, 47, 11, 12], 3),  # 70 tokens: two fla chunks
        BatchRow(list(range(30, 40)), 0, [13], 4, need_logits=False),
    ]
    before = [t.clone() for t in pools]
    logits, hidden = every.run_every_token(rows)
    for dst, src in zip(pools, before, strict=True):
        dst.copy_(src)
    rows_only = prefill.run(rows)
    for dst, src in zip(pools, before, strict=True):
        dst.copy_(src)
    with torch.inference_mode():
        batch = build_forward_batch(rows, PAGE, DEVICE)
        want = model(batch, caches.kv, caches.states, every_token=True)
    assert hidden.shape == want.shape == (81, model.config.hidden_size)
    # The graph runs the decode row as a one-token sequence, the eager forward through its decode
    # attention programs: equal to fp32 accumulation order.
    torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)
    assert logits.shape == rows_only.shape == (2, rows_only.shape[1])
    torch.testing.assert_close(logits, rows_only, atol=1e-5, rtol=1e-5)


def test_a_bucket_whose_capture_fails_runs_eager(setup, monkeypatch):
    _, graphed, prefill, _, _ = setup
    rows = [BatchRow(list(range(200)), 0, range(31, 44), 5)]  # 256 x 1: not captured yet

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", fail)
    assert prefill.run(rows) is None and not prefill.can_run(rows)
    monkeypatch.undo()
    got, _ = graphed.run(rows)  # eager, through the worker
    assert got.shape[0] == 1 and bool(torch.isfinite(got).all())


def test_captures_ahead_of_need_then_a_first_step_of_a_new_size_replays_without_one(setup):
    _, _, prefill, _, _ = setup
    captures = 0
    while prefill.capture_ahead():
        captures += 1
    assert captures > 0 and not prefill.capture_ahead()
    expected = set(ahead_of_need(prefill.token_buckets, prefill.chunk_buckets)) - prefill.failed
    assert expected <= set(prefill.graphs)
    graphs = len(prefill.graphs)
    rows = [BatchRow(list(range(90)), 0, range(31, 37), 5), BatchRow(list(range(7)), 0, [40], 6)]
    compare(setup, rows)  # 128 x 2: from the graph captured ahead
    assert len(prefill.graphs) == graphs
