"""Verify rows (speculative decoding): a row of T tokens with context that keeps the GDN state after every
token; build_forward_batch's layout of them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.ops.batch import BatchRow, build_forward_batch, logits_rows

CPU = torch.device("cpu")
PAGE = 16


def pages_for(tokens: int) -> list[int]:
    return list(range(1, 1 + -(-tokens // PAGE)))


def row(n: int, ctx: int, slot: int, state_after: tuple[int, ...] = ()) -> BatchRow:
    return BatchRow([7] * n, ctx, pages_for(ctx + n), slot, state_after=state_after)


# ---- build_forward_batch ----------------------------------------------------------------------------


def test_batch_lists_every_verify_token_for_logits_and_its_state_slots_in_row_order():
    rows = [
        row(1, 5, 1),
        row(1, 8, 2),
        row(3, 4, 3, state_after=(10, 11)),
        row(2, 16, 4, state_after=(12,)),
        dataclasses.replace(row(5, 0, 5), need_logits=False),  # a prompt chunk that samples nothing
        dataclasses.replace(row(4, 2, 6), scored=2),
    ]
    batch = build_forward_batch(rows, PAGE, CPU)
    assert (batch.num_decodes, batch.num_verify, batch.num_seqs) == (2, 2, 6)
    assert batch.query_start_loc.tolist() == [0, 1, 2, 5, 7, 12, 16]
    # decode tokens 0 and 1; verify tokens 2-4 and 5-6; the scoring chunk's last token 15; then the
    # scored tokens 12 and 13.
    assert batch.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 15, 12, 13]
    assert batch.verify_state_slots.tolist() == [10, 11, 3, 12, 4]
    assert batch.verify_state_slots.dtype == torch.int64
    assert batch.positions.tolist()[2:7] == [4, 5, 6, 16, 17]
    assert [logits_rows(r) for r in rows] == [1, 1, 3, 2, 0, 1]


def test_batch_without_verify_rows_is_unchanged():
    batch = build_forward_batch([row(1, 5, 1), row(3, 0, 2), row(1, 4, 3)], PAGE, CPU)
    assert (batch.num_decodes, batch.num_verify, batch.verify_state_slots) == (1, 0, None)
    assert batch.logits_indices.tolist() == [0, 3, 4]


def test_verify_row_after_a_prefill_chunk_is_refused():
    with pytest.raises(ValueError, match="verify row 2 follows a prefill chunk; order a batch's rows as"):
        build_forward_batch([row(1, 5, 1), row(3, 0, 2), row(2, 4, 3, state_after=(9,))], PAGE, CPU)
    # A one-token row after a verify row is a prefill chunk, so a verify row may not follow it either.
    with pytest.raises(ValueError, match="verify row 2 follows a prefill chunk"):
        rows = [row(2, 4, 3, state_after=(9,)), row(1, 5, 1), row(2, 4, 4, state_after=(10,))]
        build_forward_batch(rows, PAGE, CPU)


@pytest.mark.parametrize(
    ("bad", "found"),
    [
        (row(3, 4, 1, state_after=(9,)), "has context 4, 3 tokens, 1 state_after slots and need_logits=True"),
        (row(2, 4, 1, state_after=(9, 10)), "has context 4, 2 tokens, 2 state_after slots"),
        (row(1, 4, 1, state_after=(9,)), "has context 4, 1 tokens, 1 state_after slots"),
        (row(2, 0, 1, state_after=(9,)), "has context 0, 2 tokens, 1 state_after slots"),
        (
            dataclasses.replace(row(2, 4, 1, state_after=(9,)), need_logits=False),
            "has context 4, 2 tokens, 1 state_after slots and need_logits=False",
        ),
    ],
)
def test_malformed_verify_row_is_refused_naming_what_it_needs(bad, found):
    with pytest.raises(ValueError, match=f"verify row 1 {found}.*a verify row needs context > 0"):
        build_forward_batch([row(1, 5, 2), bad], PAGE, CPU)
