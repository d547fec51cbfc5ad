"""The decode graph's input layout (engine/cuda_graphs.fill_decode_inputs), with hand-computed values."""

from __future__ import annotations

import numpy as np

from deltaserve.engine.cuda_graphs import DUMMY_PAGE, DUMMY_SLOT, fill_decode_inputs
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
