"""The decode and verify graphs' input layouts (engine/cuda_graphs.fill_decode_inputs,
engine/spec_graphs.fill_verify_inputs and fill_block_tables), with hand-computed values."""

from __future__ import annotations

import numpy as np

from deltaserve.engine.cuda_graphs import DUMMY_PAGE, DUMMY_SLOT, fill_decode_inputs
from deltaserve.engine.spec_graphs import fill_block_tables, fill_verify_inputs
from deltaserve.ops.batch import BatchRow


def test_live_rows_then_padding_rows_on_the_reserved_page_and_slot():
    m, pages, page_size = 4, 3, 16
    longs = np.full((4, m), -9, dtype=np.int64)
    ints = np.full(2 * m + m * pages, -9, dtype=np.int32)
    rows = [
        BatchRow([101], context_len=5, pages=[7], state_slot=3),  # position 5: page 7, offset 5
        BatchRow([202], context_len=16, pages=[2, 9], state_slot=1),  # position 16: page 9, offset 0
    ]
    fill_decode_inputs(longs, ints, rows, bucket=3, page_size=page_size)
    assert longs[:, :3].tolist() == [
        [101, 202, 0],  # token ids
        [5, 16, 1],  # positions (= context lengths)
        [3, 1, DUMMY_SLOT],  # state slots
        [7 * 16 + 5, 9 * 16 + 0, DUMMY_PAGE * 16 + 1],  # KV slots
    ]
    assert longs[:, 3].tolist() == [-9] * 4  # past the bucket: untouched
    assert ints[:3].tolist() == [5, 16, 1] and ints[3] == -9  # context lengths
    assert ints[m : m + 3].tolist() == [6, 17, 2]  # sequence lengths
    tables = ints[2 * m :].reshape(m, pages)
    assert tables[0, 0] == 7 and tables[1, :2].tolist() == [2, 9] and tables[2, 0] == DUMMY_PAGE
    assert tables[3].tolist() == [-9] * 3  # rows past the bucket are not written


def test_verify_inputs_by_hand():
    # Two verify rows of t = 2 tokens into a bucket of 4 of buffers for M = 4 rows of up to 3 tokens,
    # page size 4, 3 block-table columns: the layout's offsets follow M, not this step's t.
    rows = [
        BatchRow([5, 6], 5, (7, 8), 3, state_after=(10,)),
        BatchRow([9, 1], 2, (4,), 2, state_after=(11,)),
    ]
    longs = np.full((6, 4 * 3), -1, dtype=np.int64)
    ints = np.full(2 * 4 + 4 * 3, -1, dtype=np.int32)
    fill_verify_inputs(longs, ints, rows, 4, 4, 4, accept_limits=[1, 0])
    assert longs[0, :8].tolist() == [5, 6, 9, 1, 0, 0, 0, 0]  # token ids, then padding
    assert longs[1, :8].tolist() == [5, 6, 2, 3, 1, 1, 1, 1]  # positions
    assert longs[2, :8].tolist() == [8 * 4 + 1, 8 * 4 + 2, 4 * 4 + 2, 4 * 4 + 3, 1, 1, 1, 1]  # KV slots
    assert longs[3, :8].tolist() == [10, 3, 11, 2, 0, 0, 0, 0]  # state after each token: scratch, then own
    assert longs[4, :4].tolist() == [3, 2, 0, 0] and longs[5, :4].tolist() == [1, 0, 0, 0]
    assert ints[:8].tolist() == [5, 2, 1, 1, 7, 4, 3, 3]  # context lengths, sequence lengths
    # Columns a row's drafts can reach past its pages point at the reserved page; others keep stale ids.
    assert ints[8:].reshape(4, 3).tolist() == [[7, 8, 0], [4, 0, -1], [0, 0, -1], [0, 0, -1]]


def test_block_tables_for_drafts_after_a_step_no_verify_replay_filled():
    # Drafting rows in a new order over tables a verify replay left: each row's pages land in its own
    # row; with reach 0 nothing past a row's pages is touched; padding rows get the reserved page.
    tables = np.full((4, 3), -1, dtype=np.int32)
    rows = [BatchRow([0], 20, (6, 2), 1), BatchRow([0], 3, (5,), 2)]
    fill_block_tables(tables, rows, page_size=16, reach=0)
    assert tables.tolist() == [[6, 2, -1], [5, -1, -1], [0, -1, -1], [0, -1, -1]]
    # With reach 20, positions up to 40 (row 0) and 23 (row 1) are reachable: page columns 2 and 1.
    fill_block_tables(tables, rows, page_size=16, reach=20)
    assert tables.tolist() == [[6, 2, 0], [5, 0, -1], [0, 0, -1], [0, 0, -1]]
