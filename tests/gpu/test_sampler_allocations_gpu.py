"""A batch growing by a few rows a step with Qwen3.5's card sampling (temperature, top-k, top-p, presence
penalty) takes new device memory only when its row count passes a power of two (engine/row_buffers.py),
not at every step: before, each new row count took a new block for each [rows, vocab] temporary."""

from __future__ import annotations

import torch

from deltaserve.engine.penalty_counts import PenaltyCounts, PenaltyReset
from deltaserve.engine.sampler import Sampler, SamplingRow
from deltaserve.sampling_params import SamplingParams

DEVICE = torch.device("cuda")
VOCAB = 248_320
CARD = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5)


def test_growing_batches_allocate_only_at_powers_of_two() -> None:
    counts = PenaltyCounts(200, VOCAB, DEVICE)
    counts.apply([], [PenaltyReset(slot, [1, 2, 3]) for slot in range(200)])
    sampler = Sampler(counts)
    logits = torch.randn(200, VOCAB, device=DEVICE)

    def step(n: int) -> None:
        rows = [SamplingRow(CARD, i, 4, [], [1, 2, 3]) for i in range(n)]
        for i, row in enumerate(rows):
            row.penalty_slot = i
        sampler(logits[:n], rows).token_ids.tolist()

    step(65)  # each temporary's block: for 128 rows, where it was for 65 before row buffers
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(DEVICE)["num_device_alloc"]
    for n in range(68, 129, 3):  # 21 steps, each larger than any before it, all within 128 rows
        step(n)
    torch.cuda.synchronize()
    # Before row buffers: several new blocks a step (63 or more here); a small-pool segment may still come.
    assert torch.cuda.memory_stats(DEVICE)["num_device_alloc"] - before <= 2
