"""How often each sequence has output each token, kept on the device per state slot, for the sampler's
repetition, frequency and presence penalties.

Counting a request's outputs again on the host for every step costs time in proportion to all it has
output (a step of 64 requests that have output 4,500 tokens each spent 40 ms building the counts, on
a CPU core), and needs every token on the host before the next step, so such steps could not launch
ahead. Here a slot's row is written when a request with penalties gets the slot (from the outputs it
already has: a request resumed after preemption), and each step adds the tokens the host has seen
since the last launch; the token a step launched ahead feeds a row (still on the device) is added by
the sampler for that step alone (sampler.py). Rows of slots whose request left are stale until the
slot's next request with penalties writes its own.

Both tensors (output counts int32 and prompt tokens bool, [slots, vocab]) are allocated up front on a
GPU, where the memory plan keeps room for them (engine/rank.py), and on the current stream, before any
step (an overlapped step's stream writes rows too); on the CPU at their first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.engine.row_buffers import row_buffer
from deltaserve.ops.batch import to_device


def penalty_counts_bytes(num_slots: int, vocab: int) -> int:
    """Device memory of the counts and prompt-token rows of `num_slots` slots."""
    return num_slots * vocab * (4 + 1)


@dataclass(frozen=True, slots=True)
class PenaltyReset:
    """A slot's row rewritten for the request that now holds it: its outputs so far, and its prompt
    where a repetition penalty needs it (else empty)."""

    slot: int
    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int] = ()


class PenaltyCounts:
    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab = vocab
        self.device = device
        self._counts: torch.Tensor | None = None  # [num_slots, vocab] int32: outputs per token
        self._prompt: torch.Tensor | None = None  # [num_slots, vocab] bool: the token is in the prompt
        if device.type == "cuda":
            self._tensors()

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None or self._prompt is None:
            shape = (self.num_slots, self.vocab)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._counts, self._prompt

    def apply(self, tokens: Sequence[tuple[int, int]], resets: Sequence[PenaltyReset]) -> None:
        """Adds each (slot, token) output, then rewrites the reset slots' rows (a reset's outputs already
        hold any of its tokens added here)."""
        if not tokens and not resets:
            return
        counts, prompt = self._tensors()
        if tokens:
            index = to_device(list(zip(*tokens, strict=True)), torch.int64, self.device)
            ones = torch.ones(index.shape[1], dtype=torch.int32, device=self.device)
            counts.index_put_((index[0], index[1]), ones, accumulate=True)
        for reset in resets:
            counts[reset.slot].zero_()
            prompt[reset.slot].zero_()
            if reset.output_token_ids:
                ids = to_device(reset.output_token_ids, torch.int64, self.device)
                counts[reset.slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            if reset.prompt_token_ids:
                prompt[reset.slot, to_device(reset.prompt_token_ids, torch.int64, self.device)] = True

    def rows(self, slots: torch.Tensor, *, prompt: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output counts (float32) and, with `prompt`, the prompt tokens (bool) of `slots` [P]:
        [P, vocab] each, in row buffers (engine/row_buffers.py)."""
        counts, in_prompt = self._tensors()
        n, device = slots.shape[0], self.device
        selected = torch.index_select(counts, 0, slots, out=row_buffer(n, self.vocab, torch.int32, device))
        as_float = row_buffer(n, self.vocab, torch.float32, device).copy_(selected)
        if not prompt:
            return as_float, None
        return as_float, torch.index_select(
            in_prompt, 0, slots, out=row_buffer(n, self.vocab, torch.bool, device)
        )
