"""CUDA-graph prefill (GPU only): steps with prompt chunks, decode rows beside them or not, replayed
from graphs captured per (token bucket, chunk bucket) while idle (ahead of need) or on first use.

An eager forward with a prefill chunk costs ~45 ms of kernel launching on the host whatever its size
(docs/benchmarks/2026-12-01-h200-step-host-cost.md); a replay costs two input copies and the launch.
Every row of a graphed step, decode rows included, runs as a varlen sequence (num_decodes = 0), so one
graph of bucket (T, P) covers any step of at most T tokens with at most P prompt chunks after any
number of leading decode rows (every graph has room for max_rows rows: S = max_rows below). The GDN
layers alone tell the two kinds apart, from the device count of decode rows
(ForwardBatch.graph_decodes): the decode rows take the decode kernel, and fla runs over its own
sequence list of P + 2: the decode rows' tokens as one sequence whose result is discarded (zero
initial state, final state to the reserved slot), the chunks, then empty padding. fla's state traffic
then grows with the chunks, not with every row, and a unified step reads the weights once.

Padding, all of it on the reserved KV page and state slot (nothing live is read or written):
  * tokens past the live ones belong to no sequence: their K/V go to the reserved page and their
    outputs are never read;
  * sequences past the live ones are empty (they start and end at the live token count), with the
    reserved slot (S + 1 sequences in all, so at least one); their block-table rows are never read,
    and only the first is copied to the device with the live ones; likewise fla's
    list (P + 2 sequences): its chunk list has the fixed length T // 64 + P + 1 and is padded with
    chunks of its last, empty sequence, which fla's chunked kernels skip (the real sequences' outputs
    and states are bit-identical to an unpadded call, checked on an H200).
The kernels read nothing from the host but shapes (attention, conv1d, fla given its chunk list, MoE
grouping), so a replay with new inputs computes what an eager forward of the same rows computes.

Graphs share the decode graphs' memory pool (a pool of their own with prefill overlap, where they
replay beside decode graphs: engine/backend.py); a capture that fails (out of memory) leaves that bucket
eager, with a warning, and serving goes on.

Tensor parallelism (`agree`): every rank has a runner of the same buckets, and captures a bucket at the
same moment as rank 0 (the same step's first use, an idle capture that rank 0 sends every rank as a step,
the smallest at start-up), so the captures' warm-up all-reduces meet; a bucket that failed on any rank is
marked failed on every rank, so that all of them replay the same steps (their all-reduces must match).

Ahead of need: while the engine is idle it captures the buckets serving is likely to need
(`ahead_of_need`), one per idle tick, so that a first step of each size replays instead of stalling
every running request for a capture (120-220 ms each at the 4B shape on an H200). A request that
arrives during one of these captures waits for that one capture; once the list is done nothing runs
while idle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.kv_pages import DUMMY_PAGE
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.engine.cuda_graphs import graph_buckets, padded_logits_rows
from deltaserve.engine.idle_captures import CapturesAhead
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import (
    FLA_CHUNK,
    BatchRow,
    ForwardBatch,
    fla_chunk_list,
    kv_slot,
    leading_decode_rows,
)

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
FINE_FROM, FINE_STEP = 512, 128  # token buckets past 512 are 128 apart

A = TypeVar("A", np.ndarray, torch.Tensor)


def pow2_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` below `largest`, then `largest` itself."""
    buckets, b = [], smallest
    while b < largest:
        buckets.append(b)
        b *= 2
    return [*buckets, largest]


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16 to 512, then every 128 tokens up to `max_tokens` (always included): above
    512 tokens a step's GEMMs cost in proportion to its padded size, so the padding stays under 25%."""
    small = pow2_buckets(min(MIN_TOKEN_BUCKET, max_tokens), min(max_tokens, FINE_FROM))
    return (
        small
        + list(range(FINE_FROM + FINE_STEP, max_tokens, FINE_STEP))
        + ([max_tokens] if max_tokens > FINE_FROM else [])
    )


def bucket_for(value: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= value), None)


AHEAD_MAX_CHUNKS = 4  # prompt chunks in one step below the full budget: more than 4 is rare

# A prefill graph's bucket: (tokens T, prompt chunks P).
Bucket = tuple[int, int]


def ahead_of_need(token_buckets: Sequence[int], chunk_buckets: Sequence[int]) -> list[Bucket]:
    """The buckets captured while idle, in order: one chunk (any prompt's steps, with decode rows or
    not), then two and four chunks (a step where prompts meet), the largest token bucket first within
    each, so smaller graphs reuse the shared pool's blocks instead of growing it; then the largest token
    bucket with each larger chunk count: a saturated server's steps fill the whole budget with as many
    prompts as it holds (a 4,608-token step of 1,024-token prompts: 5 or 6 chunks), and a first-use
    capture there stalls every decoder (234 ms at the 9B shape on an H200)."""
    largest = max(token_buckets)
    return [
        (tokens, chunks)
        for chunks in chunk_buckets
        if chunks <= AHEAD_MAX_CHUNKS
        for tokens in sorted(token_buckets, reverse=True)
    ] + [(largest, chunks) for chunks in chunk_buckets if chunks > AHEAD_MAX_CHUNKS]


def next_uncaptured(pending: list[Bucket], settled: Container[Bucket]) -> Bucket | None:
    """Pops the buckets at the front of `pending` that are `settled` (captured, or failed), then its
    next bucket; None when none is left."""
    while pending:
        key = pending.pop(0)
        if key not in settled:
            return key
    return None


def max_chunks(tokens: int, rows: int) -> int:
    """An upper bound on fla's chunk count for `rows` sequences of `tokens` tokens in all:
    sum(ceil(n_i / 64)) <= tokens // 64 + rows."""
    return tokens // FLA_CHUNK + rows


@dataclass(frozen=True, slots=True)
class PrefillLayout:
    """Where each input of a prefill graph lives in the two flat input buffers (int64 and int32), for
    graphs of up to `max_tokens` tokens and `max_rows` rows (max_rows + 1 sequences; fla's list of
    max_rows + 2). A bucket's inputs are prefixes of these fields, so every graph reads the same
    buffers."""

    max_tokens: int
    max_rows: int
    max_pages: int

    @property
    def seqs(self) -> int:
        return self.max_rows + 1

    @property
    def fla_seqs(self) -> int:
        return self.max_rows + 2

    @property
    def chunks(self) -> int:
        return max_chunks(self.max_tokens, self.max_rows + 1)

    @property
    def longs_size(self) -> int:
        return 3 * self.max_tokens + 2 * self.seqs + (self.fla_seqs + 1) + self.fla_seqs + 2 * self.chunks

    @property
    def ints_size(self) -> int:
        return self._ints_head + self.seqs * self.max_pages

    @property
    def _ints_head(self) -> int:
        """query_start_loc, context_lens, seq_lens, fla's context_lens and the decode count: the int32
        fields before the block tables."""
        return (self.seqs + 1) + 2 * self.seqs + self.fla_seqs + 1

    def ints_used(self, live_rows: int) -> int:
        """The int32 prefix a step of `live_rows` rows needs on the device: the block-table rows come
        last, and those of the padding sequences past the first are never read."""
        return self._ints_head + (live_rows + 1) * self.max_pages

    def views(self, longs: A, ints: A, bucket: Bucket) -> PrefillInputs[A]:
        """A bucket's inputs as views of `longs` [longs_size] and `ints` [ints_size] (host numpy
        arrays or device tensors alike)."""
        tokens_bucket, prefills_bucket = bucket
        t, s, f = self.max_tokens, self.seqs, prefills_bucket + 2
        fla = 3 * t + 2 * s  # fla's cu_seqlens, state slots, then its chunk list
        chunk_start = fla + (self.fla_seqs + 1) + self.fla_seqs
        i = self.seqs + 1
        j = i + 2 * s  # fla's context lens, the decode count, then the block tables
        blocks = j + self.fla_seqs + 1
        return PrefillInputs(
            input_ids=longs[:tokens_bucket],
            positions=longs[t : t + tokens_bucket],
            slot_mapping=longs[2 * t : 2 * t + tokens_bucket],
            state_slots=longs[3 * t : 3 * t + s],
            logits_indices=longs[3 * t + s : 3 * t + 2 * s],
            fla_cu_seqlens=longs[fla : fla + f + 1],
            fla_state_slots=longs[fla + self.fla_seqs + 1 : fla + self.fla_seqs + 1 + f],
            fla_chunk_indices=longs[
                chunk_start : chunk_start + 2 * max_chunks(tokens_bucket, prefills_bucket + 1)
            ].reshape(-1, 2),
            query_start_loc=ints[: s + 1],
            context_lens=ints[i : i + s],
            seq_lens=ints[i + s : i + 2 * s],
            fla_context_lens=ints[j : j + f],
            decode_count=ints[j + self.fla_seqs : j + self.fla_seqs + 1],
            block_tables=ints[blocks : blocks + s * self.max_pages].reshape(s, self.max_pages),
        )


@dataclass(slots=True)
class PrefillInputs(Generic[A]):
    """One bucket's inputs: T tokens, S + 1 sequences (S = max_rows), fla's list of P + 2 sequences and
    its chunk list."""

    input_ids: A  # [T]
    positions: A  # [T]
    slot_mapping: A  # [T]
    state_slots: A  # [S + 1]
    logits_indices: A  # [S + 1]: last tokens of the rows that need logits (row order), then padding
    # fla's sequences: the decode rows' tokens (discarded), the prompt chunks, then empty ones.
    fla_cu_seqlens: A  # [P + 3] int64
    fla_state_slots: A  # [P + 2] int64: the reserved slot for the first and the padding
    fla_chunk_indices: A  # [T // 64 + P + 1, 2]: (sequence, chunk) per 64-token chunk, then padding
    query_start_loc: A  # [S + 2] int32
    context_lens: A  # [S + 1]
    seq_lens: A  # [S + 1]
    fla_context_lens: A  # [P + 2] int32: 0 for the first sequence and the padding
    decode_count: A  # [1] int32: the leading decode rows
    block_tables: A  # [S + 1, max_pages]


def fill_prefill_inputs(inputs: PrefillInputs[np.ndarray], rows: Sequence[BatchRow], page_size: int) -> int:
    """Writes the host inputs of `rows` padded to the bucket of `inputs`; returns how many rows need
    logits (their hidden states are the graph's first outputs). Padding tokens sit at position 0 of the
    reserved page; padding sequences are empty, at the live token count, with the reserved slot and
    page; padding chunks are chunk 0 of fla's last sequence, which is always padding."""
    tokens_bucket = inputs.input_ids.shape[0]
    seqs = inputs.state_slots.shape[0]
    fla_seqs = inputs.fla_state_slots.shape[0]
    decodes = leading_decode_rows(rows)
    if len(rows) >= seqs:
        raise ValueError(f"{len(rows)} rows do not fit a prefill graph of {seqs - 1} rows")
    if len(rows) - decodes > fla_seqs - 2:
        raise ValueError(
            f"{len(rows) - decodes} prompt chunks do not fit a prefill graph of {fla_seqs - 2} chunks"
        )
    # Decode rows lead, one token each: row i is token i, written a column at a time.
    lead = rows[:decodes]
    if decodes > tokens_bucket:
        raise ValueError(f"rows of {decodes}+ tokens do not fit a prefill graph of {tokens_bucket} tokens")
    inputs.input_ids[:decodes] = [r.token_ids[0] for r in lead]
    inputs.positions[:decodes] = [r.context_len for r in lead]
    inputs.slot_mapping[:decodes] = [kv_slot(r.pages, r.context_len, page_size) for r in lead]
    for i, row in enumerate(lead):
        inputs.block_tables[i, : len(row.pages)] = row.pages  # later columns keep stale ids: never read
    starts = list(range(decodes + 1))
    need = [i for i, r in enumerate(lead) if r.need_logits]
    for i, row in enumerate(rows[decodes:], start=decodes):
        n = len(row.token_ids)
        start, ctx = starts[-1], row.context_len
        end = start + n
        if end > tokens_bucket:
            raise ValueError(f"rows of {end}+ tokens do not fit a prefill graph of {tokens_bucket} tokens")
        inputs.input_ids[start:end] = row.token_ids
        positions = np.arange(ctx, ctx + n)
        inputs.positions[start:end] = positions
        pages = np.asarray(row.pages, dtype=np.int64)
        inputs.slot_mapping[start:end] = pages[positions // page_size] * page_size + positions % page_size
        inputs.block_tables[i, : len(pages)] = pages  # later columns keep stale ids: never read
        if row.need_logits:
            need.append(end - 1)
        starts.append(end)
    live_rows, live_tokens = len(rows), starts[-1]
    inputs.input_ids[live_tokens:] = 0
    inputs.positions[live_tokens:] = 0
    inputs.slot_mapping[live_tokens:] = DUMMY_PAGE * page_size
    inputs.state_slots[:live_rows] = [r.state_slot for r in rows]
    inputs.state_slots[live_rows:] = DUMMY_SLOT
    context = [r.context_len for r in rows]
    inputs.context_lens[:live_rows] = context
    inputs.context_lens[live_rows:] = 0
    inputs.seq_lens[:live_rows] = np.add(context, np.diff(starts))
    inputs.seq_lens[live_rows:] = 0
    inputs.query_start_loc[: live_rows + 1] = starts
    inputs.query_start_loc[live_rows + 1 :] = live_tokens
    inputs.block_tables[live_rows:, 0] = DUMMY_PAGE
    inputs.logits_indices[: len(need)] = need
    inputs.logits_indices[len(need) :] = 0
    # fla's list: the decode rows' tokens as one sequence, the chunks, then empty sequences.
    chunk_rows = live_rows - decodes
    inputs.fla_cu_seqlens[0] = 0
    inputs.fla_cu_seqlens[1 : chunk_rows + 2] = starts[decodes:]
    inputs.fla_cu_seqlens[chunk_rows + 2 :] = live_tokens
    inputs.fla_state_slots[0] = DUMMY_SLOT
    inputs.fla_state_slots[1 : chunk_rows + 1] = [r.state_slot for r in rows[decodes:]]
    inputs.fla_state_slots[chunk_rows + 1 :] = DUMMY_SLOT
    inputs.fla_context_lens[0] = 0
    inputs.fla_context_lens[1 : chunk_rows + 1] = context[decodes:]
    inputs.fla_context_lens[chunk_rows + 1 :] = 0
    inputs.decode_count[0] = decodes
    chunks = fla_chunk_list(np.diff(inputs.fla_cu_seqlens[: chunk_rows + 2]).tolist())
    if chunks:  # none at all for the all-padding inputs of a capture
        inputs.fla_chunk_indices[: len(chunks)] = chunks
    inputs.fla_chunk_indices[len(chunks) :] = (fla_seqs - 1, 0)
    return len(need)


def graph_batch(
    inputs: PrefillInputs[torch.Tensor],
    query_lens_host: tuple[int, ...] | None = None,
    context_lens_host: tuple[int, ...] | None = None,
) -> ForwardBatch:
    """The forward batch over a bucket's inputs: every row a varlen sequence (num_decodes = 0), the
    decode rows' count on the device for the GDN layers. The GPU path reads no host lengths but their
    count; the torch reference ops loop over them, so a test that runs the reference over these inputs
    passes the real ones."""
    seqs = inputs.state_slots.shape[0]
    index = None
    if inputs.input_ids.is_cuda:
        from deltaserve.ops.triton.gdn import PrefillIndex

        # fla reads cu_seqlens_cpu only to build a chunk list, which it is given here.
        index = PrefillIndex(
            first=0,
            start=0,
            cu_seqlens=inputs.fla_cu_seqlens,
            cu_seqlens_cpu=None,
            chunk_indices=inputs.fla_chunk_indices,
            state_slots=inputs.fla_state_slots,
            context_lens=inputs.fla_context_lens,
        )
    return ForwardBatch(
        input_ids=inputs.input_ids,
        positions=inputs.positions,
        query_start_loc=inputs.query_start_loc,
        context_lens=inputs.context_lens,
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        slot_mapping=inputs.slot_mapping,
        state_slots=inputs.state_slots,
        logits_indices=inputs.logits_indices,
        num_decodes=0,
        query_lens_host=query_lens_host or (0,) * seqs,
        context_lens_host=context_lens_host or (0,) * seqs,
        gdn_prefill_index=index,
        graph_decodes=inputs.decode_count,
        graph_chunks=inputs.fla_cu_seqlens.shape[0] - 3,  # fla's list: P + 2 sequences
    )


@dataclass(frozen=True, slots=True)
class CapturedPrefill:
    """One bucket's graph and its static outputs: the final-normed hidden states of the rows that need
    logits (max_rows + 1 rows, padding past the live ones) and, when the runner keeps them, of every
    token (the bucket's token count; the MTP head reads them)."""

    graph: torch.cuda.CUDAGraph
    logits_hidden: torch.Tensor
    every_token_hidden: torch.Tensor | None


class PrefillGraphRunner:
    """Replays captured forwards of steps with prompt chunks. `can_run(rows)`: no verify rows, no
    scored prompt tokens, at most `max_tokens` tokens in at most `max_rows` rows. `run(rows)` returns
    float32 logits of the rows that need them, in row order, as an eager forward does. With
    `every_token` (speculative decoding: the MTP head reads every token's hidden state) the graphs
    also keep every token's final-normed hidden state, which `run_every_token` returns."""

    def __init__(
        self,
        model: Qwen35ForCausalLM,
        cache: DeviceCaches,
        max_rows: int,
        max_tokens: int,
        max_model_len: int,
        pool: object | None = None,
        every_token: bool = False,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        self.model = model
        self.agree = agree  # tensor parallelism: whether every rank's capture succeeded (module docstring)
        self.every_token = every_token
        self.cache = cache
        self.device = model.device
        self.token_buckets = token_buckets(max_tokens)
        self.chunk_buckets = pow2_buckets(1, max_rows)
        self.logits_buckets = graph_buckets(max_rows)  # the decode graphs' (their GEMM kernels are loaded)
        self.layout = PrefillLayout(max_tokens, max_rows, -(-max_model_len // cache.page_size))
        self._longs = torch.zeros(self.layout.longs_size, dtype=torch.int64, device=self.device)
        self._ints = torch.zeros(self.layout.ints_size, dtype=torch.int32, device=self.device)
        self._longs_host = torch.zeros(self._longs.shape, dtype=torch.int64).pin_memory()
        self._ints_host = torch.zeros(self._ints.shape, dtype=torch.int32).pin_memory()
        self._copied = torch.cuda.Event()  # the host twins may be rewritten once this has passed
        self._stream: torch.cuda.Stream | None = None
        self.pool = pool
        self.graphs: dict[Bucket, CapturedPrefill] = {}
        self.failed: set[Bucket] = set()  # buckets whose capture failed: they run eager
        wanted = ahead_of_need(self.token_buckets, self.chunk_buckets)
        self._ahead = CapturesAhead(
            "prefill graphs",
            lambda: next_uncaptured(wanted, self.graphs.keys() | self.failed),
            self._capture,
            lambda: f"{len(self.graphs)} graphs in all",
        )

    def bucket(self, rows: Sequence[BatchRow]) -> Bucket | None:
        """The (tokens, prompt chunks) bucket that runs `rows` in a graph; None: they run eager."""
        key = self._key(rows)
        return None if key is None or key in self.failed else key

    def _key(self, rows: Sequence[BatchRow]) -> Bucket | None:
        if len(rows) > self.layout.max_rows or any(r.is_verify or r.scored for r in rows):
            return None
        tokens = bucket_for(sum(len(r.token_ids) for r in rows), self.token_buckets)
        chunks = bucket_for(max(1, len(rows) - leading_decode_rows(rows)), self.chunk_buckets)
        return None if tokens is None or chunks is None else (tokens, chunks)

    def can_run(self, rows: Sequence[BatchRow]) -> bool:
        return len(rows) > 0 and self.bucket(rows) is not None

    @torch.inference_mode()
    def run(self, rows: Sequence[BatchRow], fed: torch.Tensor | None = None) -> torch.Tensor | None:
        """`fed`: input tokens of the first fed.shape[0] rows (decode rows, one token each), on the
        device. Returns None when the bucket's graph could not be captured (the caller runs eager)."""
        replayed = self._replay(rows, fed)
        return None if replayed is None else self._logits(replayed[0].logits_hidden, replayed[1])

    @torch.inference_mode()
    def run_every_token(self, rows: Sequence[BatchRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`run`'s logits and the final-normed hidden state of every live token ([tokens, hidden], in
        row order, as `model(batch, ..., every_token=True)` returns them); needs `every_token`. None
        when the bucket's graph could not be captured."""
        assert self.every_token, "run_every_token() needs a runner built with every_token=True"
        replayed = self._replay(rows, None)
        if replayed is None:
            return None
        captured, need = replayed
        assert captured.every_token_hidden is not None
        live_tokens = sum(len(r.token_ids) for r in rows)
        return self._logits(captured.logits_hidden, need), captured.every_token_hidden[:live_tokens]

    def _replay(
        self, rows: Sequence[BatchRow], fed: torch.Tensor | None
    ) -> tuple[CapturedPrefill, int] | None:
        key = self.bucket(rows)
        assert key is not None, "run() takes rows that can_run() accepts"
        captured = self.graphs.get(key) or self._capture(key)
        if captured is None:
            return None
        need = self._stage(rows, fed, key)
        captured.graph.replay()
        return captured, need

    @torch.inference_mode()
    def run_eager(self, rows: Sequence[BatchRow], fed: torch.Tensor | None = None) -> torch.Tensor:
        """The same padded forward as `run`, launched eagerly: the replay's oracle."""
        key = self._key(rows)
        assert key is not None, "run_eager() takes rows that fit a bucket"
        need = self._stage(rows, fed, key)
        batch = graph_batch(self.layout.views(self._longs, self._ints, key))
        return self._logits(self._forward(batch)[0], need)

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits rows' hidden states and, with `every_token`, every token's (the rows' are then
        gathered from them: a row's norm is its own, so the bits are those of the rows-only forward)."""
        if not self.every_token:
            return self.model(batch, self.cache.kv, self.cache.states), None
        hidden = self.model(batch, self.cache.kv, self.cache.states, every_token=True)
        return hidden[batch.logits_indices], hidden

    def _logits(self, hidden: torch.Tensor, need: int) -> torch.Tensor:
        """The first `need` rows' logits, the GEMM run over their padded row count (hidden has max_rows
        + 1 rows; those past `need` are padding)."""
        padded = min(padded_logits_rows(need, self.logits_buckets), hidden.shape[0])
        return self.model.compute_logits(hidden[:padded], rows=need)

    def _stage(self, rows: Sequence[BatchRow], fed: torch.Tensor | None, key: Bucket) -> int:
        """Writes the padded inputs of `rows` and starts their copy; returns how many rows need logits."""
        self._copied.synchronize()  # the previous replay's inputs have left the host twins
        host = self.layout.views(self._longs_host.numpy(), self._ints_host.numpy(), key)
        need = fill_prefill_inputs(host, rows, self.cache.page_size)
        self._copy_inputs(len(rows))
        if fed is not None:
            self._longs[: fed.shape[0]].copy_(fed)  # decode rows lead, one token each: token i is row i
        return need

    def _copy_inputs(self, live_rows: int) -> None:
        self._longs.copy_(self._longs_host, non_blocking=True)
        used = self.layout.ints_used(live_rows)
        self._ints[:used].copy_(self._ints_host[:used], non_blocking=True)
        self._copied.record()

    @torch.inference_mode()
    def warm(self) -> float:
        """Captures the smallest bucket at start-up, so the kernels every prefill graph runs are
        compiled then rather than in the first step that needs a graph. Returns the seconds taken."""
        started = time.monotonic()
        self._capture((self.token_buckets[0], self.chunk_buckets[0]))
        return time.monotonic() - started

    @property
    def ahead_done(self) -> bool:
        """Whether `capture_ahead` has found nothing left to capture."""
        return self._ahead.done

    @torch.inference_mode()
    def capture_ahead(self) -> bool:
        """Captures the next bucket of `ahead_of_need` not captured (or failed) yet; False when none is
        left. For idle time only: it blocks for one capture."""
        return self._ahead.step()

    def _capture(self, key: Bucket) -> CapturedPrefill | None:
        """Captures bucket `key` (None: it runs eager); with `agree`, only if every rank captured it."""
        captured = self._capture_here(key)
        everywhere = self.agree is None or self.agree(captured is not None)
        if captured is not None and not everywhere:
            del self.graphs[key]
            self.failed.add(key)
            logger.warning(
                "prefill graph for %d tokens x %d chunks not captured on another rank; those steps run eager",
                *key,
            )
            return None
        return captured

    def _capture_here(self, key: Bucket) -> CapturedPrefill | None:
        """Captures bucket `key` over all-padding inputs: one eager forward first (compiles and
        autotunes every kernel at this shape; it writes only the reserved page and slot)."""
        started = time.monotonic()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        try:
            self._copied.synchronize()
            host = self.layout.views(self._longs_host.numpy(), self._ints_host.numpy(), key)
            fill_prefill_inputs(host, [], self.cache.page_size)
            self._copy_inputs(0)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(graph_batch(self.layout.views(self._longs, self._ints, key)))
                # A second batch over the same buffers, of new tensor objects: fla memoises what it
                # derives from cu_seqlens by object identity, so the capture must miss that cache and
                # record the derivation (with the warm-up's objects it would bake in the warm-up's result).
                batch = graph_batch(self.layout.views(self._longs, self._ints, key))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"
                ):
                    logits_hidden, every_token_hidden = self._forward(batch)
        except Exception:  # out of memory, or a kernel that cannot be captured: serve this bucket eager
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.failed.add(key)
            logger.warning(
                "prefill graph for %d tokens x %d chunks not captured; those steps run eager",
                *key,
                exc_info=True,
            )
            return None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = graph.pool()
        captured = CapturedPrefill(graph, logits_hidden, every_token_hidden)
        self.graphs[key] = captured
        logger.info(
            "captured the prefill graph for %d tokens x %d chunks in %.0f ms",
            *key,
            (time.monotonic() - started) * 1e3,
        )
        return captured
