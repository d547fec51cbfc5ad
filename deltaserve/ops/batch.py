"""The one input shape the model runs: a flattened varlen batch of decode rows, verify rows and prefill
chunks.

Row order is decode rows first (one token each, context > 0), then verify rows (speculative decoding:
a sequence's last sampled token and its draft tokens, context > 0, with the GDN state kept after every
token), then prefill chunks; a prefill chunk may start at any position (its context is already in the
caches). A one-token row with context after a verify row or a prefill chunk is run as a prefill chunk.
Every tensor of a batch lives on the model's device; the `*_host` tuples mirror lengths so reference
ops can loop without device syncs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deltaserve.ops.pinned import PINNED


class CacheLayers(Protocol):
    """A device pool with one tensor pair per layer: the paged KV pool (k, v of each full-attention
    layer) or the state-slot pool (conv, ssm of each GDN layer)."""

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    query_start_loc: torch.Tensor  # [B + 1] int32, cu_seqlens of the new tokens
    context_lens: torch.Tensor  # [B] int32, tokens already cached before this step
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    block_tables: torch.Tensor  # [B, P] int32, KV page ids per sequence (padded with page 0)
    slot_mapping: torch.Tensor  # [T] int64, flat KV position (page * page_size + offset) per token
    state_slots: torch.Tensor  # [B] int64, GDN state slot per sequence
    # [R] int64, token rows whose hidden states the model returns, in row order: each decode row's token,
    # every token of each verify row, the last token of each other row that needs logits; then the
    # scored tokens (BatchRow.scored), in row order.
    logits_indices: torch.Tensor
    num_decodes: int  # the first num_decodes sequences are single-token decode rows
    query_lens_host: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    # Per-batch index the GPU GDN prefill path builds on first use and every GDN layer then shares
    # (deltaserve.ops.triton.gdn.PrefillIndex): one host->device transfer per batch, not per layer.
    gdn_prefill_index: object | None = None
    # Sequences num_decodes .. num_decodes + num_verify - 1 are verify rows. Their tokens are the rows
    # num_decodes .. num_decodes + len(verify_state_slots) - 1 (decode rows hold one token each).
    num_verify: int = 0
    # [verify tokens] int64: for each token of the verify rows, in order, the state slot that receives
    # the GDN state after it (BatchRow.state_after, then the row's own state slot for its last token).
    # None when the batch has no verify rows.
    verify_state_slots: torch.Tensor | None = None
    # Prefill graphs only: [1] int32 on the device, how many leading rows are decode rows (one token,
    # context > 0). Every op but the GPU GDN runs them as varlen sequences (num_decodes stays 0); the
    # GDN layers run them through their decode kernel (deltaserve/ops/triton/gdn.py).
    graph_decodes: torch.Tensor | None = None
    # Prefill graphs only: at most this many sequences after the decode rows hold tokens (the graph's
    # chunk bucket); the ones after them are empty padding. Set with graph_decodes.
    graph_chunks: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class BatchRow:
    """One sequence's share of a step: `token_ids` continue a sequence that already holds `context_len`."""

    token_ids: Sequence[int]
    context_len: int
    pages: Sequence[int]  # the sequence's block table; covers context_len + len(token_ids) tokens
    state_slot: int
    need_logits: bool = True  # logits of the last token of this row (of every token of a verify row)
    # Prompt scoring: the hidden states of the first `scored` tokens are returned too, after every row's
    # logits rows (logits_indices lists the sampling rows first, then the scored tokens, row order).
    scored: int = 0
    # Non-empty: a verify row (speculative decoding). It has context_len > 0, len(token_ids) >= 2 and
    # need_logits, and len(state_after) == len(token_ids) - 1: for t < len(token_ids) - 1, the GDN state
    # after its token t (every GDN layer's conv window and SSM state) is written to slot state_after[t];
    # the state after its last token goes to `state_slot`, which also holds the initial state. These
    # slots must differ from each other and from every other slot the batch reads or writes.
    state_after: Sequence[int] = ()

    @property
    def is_verify(self) -> bool:
        return len(self.state_after) > 0


def decode_rows_only(batch: ForwardBatch, tokens: int) -> bool:
    """Whether the batch's `tokens` tokens are all decode rows' (one token each, context > 0), run by the
    decode kernels alone: no verify row, no prompt chunk, not a prefill graph's batch."""
    return 0 < tokens == batch.num_decodes and batch.num_verify == 0 and batch.graph_decodes is None


def logits_rows(row: BatchRow) -> int:
    """Rows of logits the forward computes for `row`: every token of a verify row, else the last
    token's when the row needs logits."""
    if row.is_verify:
        return len(row.token_ids)
    return 1 if row.need_logits else 0


def kv_slot(pages: Sequence[int], position: int, page_size: int) -> int:
    """The flat KV position of a sequence's `position` in its block table `pages`."""
    return pages[position // page_size] * page_size + position % page_size


# fla's chunk length: its chunked GDN kernels take a chunk list naming (sequence, chunk) for every
# 64-token chunk of every sequence of a varlen batch.
FLA_CHUNK = 64


def fla_chunk_list(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """fla's chunk list of sequences of these lengths, in order (an empty sequence has no chunk)."""
    return [(seq, c) for seq, n in enumerate(lengths) for c in range(-(-n // FLA_CHUNK))]


def to_device(data: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values to `device` in one copy; on CUDA staged in a reused page-locked buffer
    (ops/pinned.py), so the copy blocks neither the host nor the stream."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        # A capture would bake a reused buffer's address into the graph: stage a fresh one there.
        return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return PINNED.upload(data, dtype, device)


# Row kinds, in the order a batch holds them.
_DECODE, _VERIFY, _PREFILL = 0, 1, 2


def _decode_shaped(row: BatchRow) -> bool:
    return len(row.token_ids) == 1 and row.context_len > 0 and not row.is_verify


def leading_decode_rows(rows: Sequence[BatchRow]) -> int:
    """How many rows a batch of `rows` runs as decode rows: the decode-shaped rows at its front."""
    n = 0
    while n < len(rows) and _decode_shaped(rows[n]):
        n += 1
    return n


def _row_kind(index: int, row: BatchRow, previous: int) -> int:
    """The kind of row `index` of a batch whose previous row was of kind `previous`. A decode-shaped row
    after the decode rows is a prefill chunk; a verify row after a prefill chunk is an error."""
    n = len(row.token_ids)
    if not row.is_verify:
        return _DECODE if _decode_shaped(row) and previous == _DECODE else _PREFILL
    if row.context_len < 1 or n < 2 or len(row.state_after) != n - 1 or not row.need_logits:
        raise ValueError(
            f"verify row {index} has context {row.context_len}, {n} tokens, {len(row.state_after)} "
            f"state_after slots and need_logits={row.need_logits}; a verify row needs context > 0, at "
            "least 2 tokens, len(token_ids) - 1 state_after slots and need_logits=True"
        )
    if previous == _PREFILL:
        raise ValueError(
            f"verify row {index} follows a prefill chunk; order a batch's rows as decode rows, then "
            "verify rows, then prefill chunks"
        )
    return _VERIFY


def build_forward_batch(rows: Sequence[BatchRow], page_size: int, device: torch.device) -> ForwardBatch:
    if not rows:
        raise ValueError("a forward batch needs at least one row")
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start = [0]
    logits_indices: list[int] = []
    scored_indices: list[int] = []
    verify_slots: list[int] = []
    max_pages = max(len(r.pages) for r in rows)
    block_tables: list[list[int]] = []
    counts = [0, 0, 0]  # rows of each kind
    kind = _DECODE
    for i, row in enumerate(rows):
        n = len(row.token_ids)
        end = row.context_len + n
        if n < 1:
            raise ValueError("a batch row needs at least one token")
        if len(row.pages) * page_size < end:
            raise ValueError(f"row covers {end} tokens but holds only {len(row.pages)} pages of {page_size}")
        kind = _row_kind(i, row, kind)
        counts[kind] += 1
        input_ids.extend(row.token_ids)
        for pos in range(row.context_len, end):
            positions.append(pos)
            # kv_slot(row.pages, pos, page_size), inlined: this loop runs per token of the step
            slot_mapping.append(row.pages[pos // page_size] * page_size + pos % page_size)
        query_start.append(query_start[-1] + n)
        if kind == _VERIFY:
            logits_indices.extend(range(query_start[-2], query_start[-1]))
            verify_slots.extend([*row.state_after, row.state_slot])
        elif row.need_logits:
            logits_indices.append(query_start[-1] - 1)
        if not 0 <= row.scored <= n:
            raise ValueError(f"a row of {n} tokens cannot score {row.scored} of them")
        scored_indices.extend(range(query_start[-2], query_start[-2] + row.scored))
        block_tables.append(list(row.pages) + [0] * (max_pages - len(row.pages)))

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        # Without waiting for the stream: a plain torch.tensor(..., device=cuda) would first drain it,
        # stalling this launch behind a step launched ahead.
        return to_device(values, dtype, device)

    context = [r.context_len for r in rows]
    query = [len(r.token_ids) for r in rows]
    return ForwardBatch(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        query_start_loc=t(query_start, torch.int32),
        context_lens=t(context, torch.int32),
        seq_lens=t([c + q for c, q in zip(context, query, strict=True)], torch.int32),
        block_tables=t(block_tables, torch.int32),
        slot_mapping=t(slot_mapping, torch.int64),
        state_slots=t([r.state_slot for r in rows], torch.int64),
        logits_indices=t(logits_indices + scored_indices, torch.int64),
        num_decodes=counts[_DECODE],
        query_lens_host=tuple(query),
        context_lens_host=tuple(context),
        num_verify=counts[_VERIFY],
        verify_state_slots=t(verify_slots, torch.int64) if verify_slots else None,
    )
