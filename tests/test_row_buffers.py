"""The sampler's per-step [rows, vocab] temporaries are allocated at a power-of-two row count
(engine/row_buffers.py), so a batch growing by a few rows per step reuses the allocator's cached blocks
instead of taking a new one each step. Checked on the storage behind each temporary."""

from __future__ import annotations

import pytest
import torch

import deltaserve.engine.sampler as sampler_module
from deltaserve.engine.penalty_counts import PenaltyCounts, PenaltyReset
from deltaserve.engine.row_buffers import padded_rows, row_buffer
from deltaserve.engine.sampler import Sampler, SamplingRow, process_logits
from deltaserve.sampling_params import SamplingParams

VOCAB = 40


def allocated_rows(t: torch.Tensor) -> int:
    """Rows of `t`'s width its storage holds."""
    return t.untyped_storage().nbytes() // (t.shape[1] * t.element_size())


def rows_of(n: int, **params) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(**params), i, 3, [1, 2], [5, 5, 7]) for i in range(n)]


def test_padded_rows_by_hand() -> None:
    assert [padded_rows(n) for n in (0, 1, 2, 3, 4, 5, 64, 65, 300, 512)] == [
        0,
        1,
        2,
        4,
        4,
        8,
        64,
        128,
        512,
        512,
    ]
    t = row_buffer(5, VOCAB, torch.float32, torch.device("cpu"))
    assert t.shape == (5, VOCAB) and t.is_contiguous() and allocated_rows(t) == 8


@pytest.mark.parametrize("n", [5, 6, 7])
def test_the_float32_copy_and_the_penalties_of_five_to_seven_rows_share_eight_row_allocations(n) -> None:
    logits = torch.randn(n, VOCAB)
    presence = process_logits(
        logits, rows_of(n, temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5)
    )
    assert allocated_rows(presence) == 8
    repeated = process_logits(
        logits, rows_of(n, temperature=1.0, repetition_penalty=1.3, presence_penalty=1.5)
    )
    assert allocated_rows(repeated) == 8
    mixed = rows_of(n - 1, temperature=1.0, presence_penalty=1.5) + rows_of(1, temperature=1.0)
    assert allocated_rows(process_logits(logits, mixed)) == 8  # the step's copy; the penalised rows' too


def test_penalty_count_rows_come_in_row_buffers() -> None:
    counts = PenaltyCounts(8, VOCAB, torch.device("cpu"))
    counts.apply([], [PenaltyReset(slot, [1, 2, 2], [3]) for slot in range(8)])
    as_float, prompt = counts.rows(torch.tensor([0, 1, 2, 3, 4]))
    assert allocated_rows(as_float) == 8 and prompt is not None and allocated_rows(prompt) == 8
    assert as_float[0, 2].item() == 2.0 and bool(prompt[4, 3])
    assert counts.rows(torch.tensor([0, 1, 2]), prompt=False)[1] is None


@pytest.mark.parametrize("params", [{"top_k": 5}, {"top_p": 0.9}, {}])
def test_the_scaled_scores_of_a_sampled_sub_batch_come_in_a_row_buffer(monkeypatch, params) -> None:
    seen: list[torch.Tensor] = []
    draw = sampler_module._gumbel_argmax

    def recording(scores, seed, step):
        seen.append(scores)
        return draw(scores, seed, step)

    monkeypatch.setattr(sampler_module, "_gumbel_argmax", recording)
    sampled = rows_of(5, temperature=0.8, **params)
    Sampler()(torch.randn(6, VOCAB), [*sampled, *rows_of(1, temperature=0.0)])  # a sub-batch of 5
    Sampler()(torch.randn(5, VOCAB), sampled)  # the whole batch
    assert [tuple(s.shape) for s in seen] == [(5, VOCAB), (5, VOCAB)]
    assert [allocated_rows(s) for s in seen] == [8, 8]


def test_noise_chunks_are_a_power_of_two_of_rows_and_a_shorter_last_one_fits_in_a_full_ones(
    monkeypatch,
) -> None:
    made: list[tuple[int, torch.dtype]] = []

    def recording(rows, cols, dtype, device):
        made.append((rows, dtype))
        return row_buffer(rows, cols, dtype, device)

    monkeypatch.setattr(sampler_module, "row_buffer", recording)
    monkeypatch.setattr(sampler_module, "_NOISE_CHUNK_ELEMS", 5 * VOCAB)  # chunks of 4 rows
    Sampler()(torch.randn(6, VOCAB), rows_of(6, temperature=0.7))
    noise = [rows for rows, dtype in made if dtype == torch.int64]
    assert noise == [4, 4, 2, 2]  # the hashed counters and their scratch, per chunk
    assert max(padded_rows(r) for r, _ in made) == 8  # the scaled scores of 6 rows
