"""The prefill graphs' input layout (engine/prefill_graphs.py): buckets and padding by hand, the padded
batch through the torch reference model against the same rows unpadded, and the ranks' agreement on a
capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaserve.cache.device import build_device_caches
from deltaserve.cache.kv_pages import DUMMY_PAGE
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.config import ModelConfig
from deltaserve.engine.prefill_graphs import (
    PrefillGraphRunner,
    PrefillLayout,
    ahead_of_need,
    bucket_for,
    fill_prefill_inputs,
    graph_batch,
    max_chunks,
    next_uncaptured,
    pow2_buckets,
    token_buckets,
)
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import load_weights
from deltaserve.ops.batch import BatchRow, build_forward_batch
from deltaserve.tiny import default_model_dir


def test_buckets_by_hand():
    assert pow2_buckets(16, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert pow2_buckets(16, 1000) == [16, 32, 64, 128, 256, 512, 1000]
    assert pow2_buckets(1, 6) == [1, 2, 4, 6]
    assert pow2_buckets(1, 1) == [1]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 640, 768, 896, 1000]
    assert token_buckets(1024)[-3:] == [768, 896, 1024] and token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert token_buckets(8) == [8] and token_buckets(512)[-1] == 512
    assert (
        bucket_for(17, [16, 32]) == 32 and bucket_for(16, [16, 32]) == 16 and bucket_for(33, [16, 32]) is None
    )
    # 64 tokens in one row: 1 chunk; 65 tokens in two rows of 64 + 1: 2 chunks; the bound covers both.
    assert max_chunks(64, 1) == 2 and max_chunks(65, 2) == 3


def test_buckets_captured_ahead_of_need_by_hand():
    # Chunks 1, 2 and 4, decode rows beside them or not, the largest tokens first in each; more chunks
    # only at the full budget (a saturated step).
    assert ahead_of_need([16, 32, 512, 640], [1, 2, 4, 8, 16]) == [
        (640, 1), (512, 1), (32, 1), (16, 1),
        (640, 2), (512, 2), (32, 2), (16, 2),
        (640, 4), (512, 4), (32, 4), (16, 4),
        (640, 8), (640, 16),
    ]  # fmt: skip
    assert ahead_of_need([16, 32], [1, 3]) == [(32, 1), (16, 1), (32, 3), (16, 3)]
    assert ahead_of_need([16], [1]) == [(16, 1)]


def test_the_next_bucket_to_capture_skips_those_captured_meanwhile():
    pending = [(64, 1), (32, 1), (16, 1), (64, 2)]
    assert next_uncaptured(pending, {(64, 1)}) == (32, 1) and pending == [(16, 1), (64, 2)]
    # The last ones captured on first use meanwhile: none left, so the list is done.
    assert next_uncaptured(pending, {(16, 1), (64, 2)}) is None and pending == []
    assert next_uncaptured(pending, set()) is None


def test_rows_then_padding_by_hand():
    layout = PrefillLayout(max_tokens=8, max_rows=2, max_pages=2)
    longs = np.full(layout.longs_size, -9, dtype=np.int64)
    ints = np.full(layout.ints_size, -9, dtype=np.int32)
    rows = [
        BatchRow([11], context_len=5, pages=[7, 2], state_slot=3),  # a decode row: position 5 on page 2
        BatchRow([21, 22, 23], context_len=0, pages=[9], state_slot=1, need_logits=False),
    ]
    inputs = layout.views(longs, ints, (8, 1))
    need = fill_prefill_inputs(inputs, rows, page_size=4)
    assert need == 1
    assert inputs.input_ids.tolist() == [11, 21, 22, 23, 0, 0, 0, 0]
    assert inputs.positions.tolist() == [5, 0, 1, 2, 0, 0, 0, 0]
    pad = DUMMY_PAGE * 4
    assert inputs.slot_mapping.tolist() == [2 * 4 + 1, 9 * 4, 9 * 4 + 1, 9 * 4 + 2, pad, pad, pad, pad]
    # Three sequences: the two rows, then an empty one at the live token count.
    assert inputs.state_slots.tolist() == [3, 1, DUMMY_SLOT]
    assert inputs.query_start_loc.tolist() == [0, 1, 4, 4]
    assert inputs.context_lens.tolist() == [5, 0, 0] and inputs.seq_lens.tolist() == [6, 3, 0]
    assert inputs.block_tables.tolist() == [[7, 2], [9, -9], [DUMMY_PAGE, -9]]
    assert inputs.logits_indices.tolist() == [0, 0, 0]  # the decode row's token, then padding
    # fla's list (1 chunk + 2): the decode row's token as a sequence from zeros into the reserved slot,
    # the chunk, an empty one; 8 // 64 + 1 + 1 = 2 chunk entries, one per non-empty sequence.
    assert inputs.decode_count.tolist() == [1]
    assert inputs.fla_cu_seqlens.tolist() == [0, 1, 4, 4]
    assert inputs.fla_state_slots.tolist() == [DUMMY_SLOT, 1, DUMMY_SLOT]
    assert inputs.fla_context_lens.tolist() == [0, 0, 0]
    assert inputs.fla_chunk_indices.tolist() == [[0, 0], [1, 0]]
    # A smaller bucket of the same buffers: the same offsets, shorter prefixes.
    small = layout.views(longs, ints, (4, 1))
    fill_prefill_inputs(small, rows[1:], page_size=4)
    assert small.query_start_loc.tolist() == [0, 3, 3, 3]
    assert small.state_slots.tolist() == [1, DUMMY_SLOT, DUMMY_SLOT]
    assert small.logits_indices.tolist() == [0, 0, 0] and small.fla_chunk_indices.tolist() == [[1, 0], [2, 0]]
    assert small.decode_count.tolist() == [0] and small.fla_cu_seqlens.tolist() == [0, 0, 3, 3]
    assert longs[layout.max_tokens + 3] == 0  # padding position past the small bucket's live tokens


def test_decode_rows_lead_fla_sees_them_as_one_sequence_and_the_chunks_after():
    layout = PrefillLayout(max_tokens=256, max_rows=8, max_pages=6)
    longs = np.full(layout.longs_size, -9, dtype=np.int64)
    ints = np.full(layout.ints_size, -9, dtype=np.int32)
    decode = [BatchRow([10 + i], 20 + i, [1, 2], 4 + i) for i in range(3)]
    chunk = BatchRow(list(range(70)), 12, [3, 4, 5, 6, 7, 9], 2)  # context 12: starts from its slot
    after = BatchRow([5], 6, [8], 1)  # one token with context after a chunk: a chunk, not a decode row
    inputs = layout.views(longs, ints, (128, 2))
    assert fill_prefill_inputs(inputs, [*decode, chunk, after], page_size=16) == 5
    assert inputs.decode_count.tolist() == [3]
    # Tokens: 3 decode rows (0-2), the chunk (3-72), the last row (73); fla: [0, 3), [3, 73), [73, 74).
    assert inputs.query_start_loc.tolist()[:6] == [0, 1, 2, 3, 73, 74]
    assert inputs.fla_cu_seqlens.tolist() == [0, 3, 73, 74, 74]
    assert inputs.fla_state_slots.tolist() == [DUMMY_SLOT, 2, 1, DUMMY_SLOT]
    assert inputs.fla_context_lens.tolist() == [0, 12, 6, 0]
    # 128 // 64 + 2 + 1 = 5 entries: the decode tokens' chunk, the 70-token chunk's two, the last row's,
    # then one padding chunk of the last (empty) sequence.
    assert inputs.fla_chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0]]
    with pytest.raises(ValueError, match="3 prompt chunks do not fit a prefill graph of 2 chunks"):
        fill_prefill_inputs(inputs, [*decode, chunk, after, after], page_size=16)


def test_padding_chunks_name_the_last_empty_sequence():
    layout = PrefillLayout(max_tokens=256, max_rows=4, max_pages=40)
    longs = np.zeros(layout.longs_size, dtype=np.int64)
    ints = np.zeros(layout.ints_size, dtype=np.int32)
    inputs = layout.views(longs, ints, (256, 2))
    rows = [BatchRow(list(range(130)), 0, list(range(1, 10)), 2)]  # 130 tokens: chunks 0, 1, 2
    assert fill_prefill_inputs(inputs, rows, page_size=16) == 1
    # fla's list of 4: the (empty) decode-token sequence, the row, two empty; 256 // 64 + 3 = 7 entries.
    assert inputs.fla_chunk_indices.tolist() == [[1, 0], [1, 1], [1, 2], [3, 0], [3, 0], [3, 0], [3, 0]]
    assert inputs.logits_indices.tolist() == [129, 0, 0, 0, 0]
    # No rows at all (a capture's inputs): every sequence empty, every chunk a padding chunk.
    assert fill_prefill_inputs(inputs, [], page_size=16) == 0
    assert inputs.query_start_loc.tolist() == [0] * 6 and inputs.state_slots.tolist() == [DUMMY_SLOT] * 5
    assert inputs.fla_state_slots.tolist() == [DUMMY_SLOT] * 4 and inputs.decode_count.tolist() == [0]
    assert inputs.fla_chunk_indices.tolist() == [[3, 0]] * 7 and inputs.slot_mapping.tolist() == [0] * 256
    with pytest.raises(ValueError, match="2 prompt chunks do not fit a prefill graph of 1 chunks"):
        fill_prefill_inputs(layout.views(longs, ints, (256, 1)), rows * 2, page_size=16)
    one = [BatchRow([1], 0, [1], 2)]
    with pytest.raises(ValueError, match="5 rows do not fit a prefill graph of 4 rows"):
        fill_prefill_inputs(layout.views(longs, ints, (256, 4)), one * 5, page_size=16)
    with pytest.raises(ValueError, match="do not fit a prefill graph of 128 tokens"):
        fill_prefill_inputs(layout.views(longs, ints, (128, 2)), rows, page_size=16)


def test_padded_batch_through_the_reference_model_equals_the_rows_unpadded():
    """Decode rows run as sequences, padding tokens and empty sequences write only the reserved page
    and slot: logits, the live KV pages and the live state slots are what the eager batch gives."""
    model_dir = default_model_dir()
    cfg = ModelConfig.from_dir(model_dir)
    model = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=torch.device("cpu"))
    load_weights(model, model_dir)
    page = 4
    caches = build_device_caches(
        cfg, num_pages=16, page_size=page, num_slots=8, dtype=torch.float32, device=torch.device("cpu")
    )
    pools = (caches.kv.k, caches.kv.v, caches.states.conv, caches.states.ssm)  # every layer's
    torch.manual_seed(0)
    for t in pools:  # idle pages and slots hold values a stray write would change
        t.normal_()
    # Context first: 6 tokens in slot 1 (pages 3, 4), 9 in slot 2 (pages 5, 6, 7).
    history = [BatchRow(list(range(40, 46)), 0, [3, 4], 1), BatchRow(list(range(60, 69)), 0, [5, 6, 7], 2)]
    with torch.inference_mode():
        model(build_forward_batch(history, page, model.device), caches.kv, caches.states)
    rows = [
        BatchRow([7], 6, [3, 4], 1),  # decode row
        BatchRow([8, 9, 10], 9, [5, 6, 7], 2),  # chunk with context
        BatchRow([1, 2, 3, 4, 5], 0, [8, 9], 3),  # whole prompt
        BatchRow([6, 5, 4, 3], 0, [10], 4, need_logits=False),  # first chunk of a longer prompt
    ]
    before = [t.clone() for t in pools]

    def restore() -> None:
        for dst, src in zip(pools, before, strict=True):
            dst.copy_(src)

    with torch.inference_mode():
        eager = model.compute_logits(
            model(build_forward_batch(rows, page, model.device), caches.kv, caches.states)
        )
        after_eager = [t.clone() for t in pools]
        restore()
        layout = PrefillLayout(max_tokens=32, max_rows=8, max_pages=4)
        longs = torch.full((layout.longs_size,), -1, dtype=torch.int64)
        ints = torch.full((layout.ints_size,), -1, dtype=torch.int32)
        need = fill_prefill_inputs(layout.views(longs.numpy(), ints.numpy(), (16, 4)), rows, page)
        lens, contexts = (1, 3, 5, 4) + (0,) * 5, (6, 9) + (0,) * 7  # 8 rows + 1: padding past the 4
        batch = graph_batch(layout.views(longs, ints, (16, 4)), lens, contexts)
        padded = model.compute_logits(model(batch, caches.kv, caches.states)[:need])
        after_padded = [t.clone() for t in pools]
    assert need == 3
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    k_e, v_e, conv_e, ssm_e = after_eager
    k_p, v_p, conv_p, ssm_p = after_padded
    live_pages, live_slots = [3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4]
    # Pools are [layers, pages or slots, ...]. The padded forward's GEMMs have more rows, so they may
    # add in another order, and the difference grows through the layers (1.8e-5 on a 0.55 key in the
    # second layer with AVX2 kernels): fp32 noise, orders of magnitude below any indexing error.
    fp32_noise = {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(k_p[:, live_pages], k_e[:, live_pages], **fp32_noise)
    torch.testing.assert_close(v_p[:, live_pages], v_e[:, live_pages], **fp32_noise)
    torch.testing.assert_close(conv_p[:, live_slots], conv_e[:, live_slots], **fp32_noise)
    torch.testing.assert_close(ssm_p[:, live_slots], ssm_e[:, live_slots], **fp32_noise)
    # Everything else the padded forward touched is the reserved page and slot.
    others = [p for p in range(16) if p not in live_pages and p != DUMMY_PAGE]
    k0, v0, conv0, ssm0 = before
    assert torch.equal(k_p[:, others], k0[:, others]) and torch.equal(v_p[:, others], v0[:, others])
    idle = [s for s in range(8) if s not in live_slots and s != DUMMY_SLOT]
    assert torch.equal(conv_p[:, idle], conv0[:, idle]) and torch.equal(ssm_p[:, idle], ssm0[:, idle])


def _runner_capturing(captured_here: bool, everywhere: bool) -> tuple[PrefillGraphRunner, list[bool]]:
    """A runner (no CUDA state) whose capture here succeeds or fails, among ranks that agree or not."""
    runner = PrefillGraphRunner.__new__(PrefillGraphRunner)
    runner.graphs, runner.failed, told = {}, set(), []

    def capture_here(key):
        if not captured_here:
            runner.failed.add(key)
            return None
        runner.graphs[key] = "graph"
        return "graph"

    def agree(ok: bool) -> bool:
        told.append(ok)
        return ok and everywhere

    runner._capture_here = capture_here
    runner.agree = agree
    return runner, told


@pytest.mark.parametrize(
    ("here", "everywhere", "kept"), [(True, True, True), (True, False, False), (False, False, False)]
)
def test_a_bucket_replays_only_if_every_rank_captured_it(here, everywhere, kept):
    """Tensor parallelism: every rank must replay the same steps (their all-reduces must match), so a
    bucket that failed on another rank is dropped here too; every rank takes part in the agreement."""
    runner, told = _runner_capturing(here, everywhere)
    got = runner._capture((64, 1))
    assert told == [here]
    assert (got == "graph") is kept and ((64, 1) in runner.graphs) is kept
    assert ((64, 1) in runner.failed) is not kept
