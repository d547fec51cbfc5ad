"""CUDA graphs for speculative steps (GPU only): the verify forward, the MTP pass over its tokens and the
MTP's draft steps, each captured per batch bucket over static input buffers.

A step the graphs run holds verify rows only, each of the same k + 1 tokens (the scheduler pads a row
with fewer proposals, which only costs rejections). Captured per (bucket, k) for k in 1..K:
  verify: the target forward over bucket x (k + 1) tokens -> final-normed hidden and logits of every token
  mtp:    the MTP head over the same tokens (next-token ids and that hidden state in static buffers)
and per bucket: one MTP draft step (a token per row at its own position) -> hidden and draft logits, and
the MTP pass over one token per row (a step of 1-token prompts or of decoders without proposals, whose
target forward a prefill graph ran). Drafts after such a step replay the draft graphs too, over block
tables loaded for their rows.
A step whose rows are all greedy (no logit processing, no logprobs) runs as ONE graph per (bucket, k)
instead, with nothing on the host between its parts:
  greedy: verify -> argmax per position -> accepted drafts per row (capped per row) -> state commit
          -> MTP pass -> first proposal at each row's last accepted position -> k - 1 draft steps at
          positions computed on the device -> [targets | accepted | proposals] in one output tensor.
Padding rows (bucket > live rows) point at the reserved KV page 0 and state slot 0, so they never touch
a live sequence. The host fills the inputs once per step (two copies) and each draft step's positions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.kv_pages import DUMMY_PAGE
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.engine.cuda_graphs import decode_batch_over, graph_buckets
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, ForwardBatch, kv_slot


def fill_verify_inputs(
    longs: np.ndarray,
    ints: np.ndarray,
    rows: Sequence[BatchRow],
    bucket: int,
    page_size: int,
    max_rows: int,
    accept_limits: Sequence[int] = (),
) -> None:
    """Writes a verify graph's inputs for `rows` (t tokens each) padded to `bucket` rows. M = max_rows
    (the buffers' row capacity, whatever this step's t). longs [6, >= M*t] int64, per token: id,
    position, KV slot, state slot after it (its scratch slot, the row's own after the last); per row,
    in the first M entries: state slot, acceptance cap. ints [2M + M*P] int32: context lengths [M],
    sequence lengths [M], then the block table [M, P] row-major. Block-table
    columns a row's drafts can reach past its pages are zeroed (the reserved page): the greedy chain
    writes MTP K/V at positions up to context + 2t - 2 whether the row drafts or not. Padding rows hold
    their tokens from position 1 of the reserved page, with the reserved state slot."""
    n, t = len(rows), len(rows[0].token_ids)
    m = max_rows
    max_pages = (ints.shape[0] - 2 * m) // m
    tokens, positions, slots, after = [], [], [], []
    for r in rows:
        tokens += r.token_ids
        for i in range(t):
            pos = r.context_len + i
            positions.append(pos)
            slots.append(kv_slot(r.pages, pos, page_size))
        after += [*r.state_after, r.state_slot]
    used = n * t
    longs[0, :used] = tokens
    longs[1, :used] = positions
    longs[2, :used] = slots
    longs[3, :used] = after
    longs[4, :n] = [r.state_slot for r in rows]
    longs[5, :n] = list(accept_limits) if accept_limits else 0
    ints[:n] = [r.context_len for r in rows]
    ints[m : m + n] = [r.context_len + t for r in rows]
    fill_block_tables(
        ints[2 * m : 2 * m + bucket * max_pages].reshape(bucket, max_pages), rows, page_size, 2 * t
    )
    pad = slice(used, bucket * t)
    longs[0, pad] = 0
    longs[1, pad] = 1
    longs[2, pad] = DUMMY_PAGE * page_size + 1
    longs[3, pad] = DUMMY_SLOT
    longs[4:, n:bucket] = [[DUMMY_SLOT], [0]]
    ints[n:bucket] = 1
    ints[m + n : m + bucket] = 1 + t


def fill_block_tables(tables: np.ndarray, rows: Sequence[BatchRow], page_size: int, reach: int) -> None:
    """tables [bucket, P]: row i's pages, then the reserved page over the further columns that positions
    up to its context + reach can touch; padding rows (from len(rows)) the reserved page over the columns
    positions up to 1 + reach touch. Columns past those are left as they are: no position reads them."""
    max_pages = tables.shape[1]
    for i, r in enumerate(rows):
        tables[i, : len(r.pages)] = r.pages
        tables[i, len(r.pages) : min(max_pages, (r.context_len + reach) // page_size + 1)] = DUMMY_PAGE
    tables[len(rows) :, : min(max_pages, (1 + reach) // page_size + 1)] = DUMMY_PAGE


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]


class SpeculativeGraphs:
    """`can_run(rows)`: verify rows only, all of k + 1 tokens, at most the largest bucket. `verify(rows)`
    replays the target forward and returns (hidden, logits) of every token; `mtp(ids, hidden)` then
    runs the MTP head over the same tokens; `draft(tokens, hidden, positions)` one draft step."""

    def __init__(
        self,
        model: Qwen35ForCausalLM,
        caches: DeviceCaches,
        max_rows: int,
        max_drafts: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.caches = caches
        self.device = model.device
        self.buckets = graph_buckets(max_rows)
        self.max_rows = self.buckets[-1]
        self.max_drafts = max_drafts
        page = caches.page_size
        # Verify rows and their proposals reach 2K positions past a request's last token.
        self.max_pages = -(-(max_model_len + 2 * max_drafts) // page)
        n, t, dev = self.max_rows, max_drafts + 1, self.device
        hidden = model.config.hidden_size
        # The verify inputs live in two device buffers with pinned host twins (fill_verify_inputs), so a
        # step's inputs go over in two copies. The named tensors are views into them.
        self._longs = torch.zeros(6, n * t, dtype=torch.int64, device=dev)
        self._ints = torch.zeros(2 * n + n * self.max_pages, dtype=torch.int32, device=dev)
        self._longs_host = torch.zeros(self._longs.shape, dtype=torch.int64).pin_memory()
        self._ints_host = torch.zeros(self._ints.shape, dtype=torch.int32).pin_memory()
        self._copied = torch.cuda.Event()  # the host twins may be rewritten once this has passed
        self.tokens, self.positions, self.slot_mapping, self.verify_slots = self._longs[:4].unbind(0)
        self.state_slots = self._longs[4, :n]
        self.accept_limits = self._longs[5, :n]
        self.context_lens = self._ints[:n]
        self.seq_lens = self._ints[n : 2 * n]
        self.block_tables = self._ints[2 * n :].view(n, self.max_pages)
        self.mtp_ids = torch.zeros(n * t, dtype=torch.int64, device=dev)
        self.mtp_hidden_in = torch.zeros(n * t, hidden, dtype=model.dtype, device=dev)
        self.logits_indices = torch.arange(n * t, dtype=torch.int64, device=dev)
        # Every verify graph writes its logits into the front of this one buffer (as the decode graphs
        # share theirs: engine/cuda_graphs.py); a step reads them before the next verify replay.
        self.verify_logits = torch.empty(n * t, model.logits_vocab_size, dtype=torch.float32, device=dev)
        self.query_starts = {
            k: torch.arange(n + 1, dtype=torch.int32, device=dev) * (k + 1) for k in range(0, max_drafts + 1)
        }
        # Draft steps: one token per row.
        self.draft_tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.draft_hidden = torch.zeros(n, hidden, dtype=model.dtype, device=dev)
        self.draft_positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.draft_slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.draft_context = torch.zeros(n, dtype=torch.int32, device=dev)
        self.draft_seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.force_accept = torch.zeros(1, dtype=torch.bool, device=dev)  # benchmark only
        self.verify_graphs: dict[tuple[int, int], _Captured] = {}
        self.greedy_graphs: dict[tuple[int, int], _Captured] = {}
        self.mtp_graphs: dict[tuple[int, int], _Captured] = {}
        self.draft_graphs: dict[int, _Captured] = {}
        self.single_mtp_graphs: dict[int, _Captured] = {}
        self.pool = None

    # ---- batches over the static buffers ---------------------------------------------------------

    def _verify_batch(self, rows: int, k: int) -> ForwardBatch:
        n = rows * (k + 1)
        return ForwardBatch(
            input_ids=self.tokens[:n],
            positions=self.positions[:n],
            query_start_loc=self.query_starts[k][: rows + 1],
            context_lens=self.context_lens[:rows],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            slot_mapping=self.slot_mapping[:n],
            state_slots=self.state_slots[:rows],
            logits_indices=self.logits_indices[:n],
            num_decodes=0,
            query_lens_host=(k + 1,) * rows,
            context_lens_host=(1,) * rows,  # never read on the GPU
            num_verify=rows,
            verify_state_slots=self.verify_slots[:n],
        )

    def _single_batch(self, rows: int) -> ForwardBatch:
        """One token per row over the verify buffers (fill_verify_inputs with t = 1), as decode rows."""
        return decode_batch_over(
            rows,
            input_ids=self.tokens,
            positions=self.positions,
            query_start_loc=self.query_starts[0],
            context_lens=self.context_lens,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            state_slots=self.state_slots,
            logits_indices=self.logits_indices,
        )

    def _draft_batch(self, rows: int) -> ForwardBatch:
        return decode_batch_over(
            rows,
            input_ids=self.draft_tokens,
            positions=self.draft_positions,
            query_start_loc=self.query_starts[0],
            context_lens=self.draft_context,
            seq_lens=self.draft_seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.draft_slot_mapping,
            state_slots=self.state_slots,
            logits_indices=self.logits_indices,
        )

    def _reset_padding(self) -> None:
        page = self.caches.page_size
        self.tokens.zero_()
        self.mtp_ids.zero_()
        self.draft_tokens.zero_()
        self.positions.fill_(1)
        self.draft_positions.fill_(1)
        self.slot_mapping.fill_(DUMMY_PAGE * page + 1)
        self.draft_slot_mapping.fill_(DUMMY_PAGE * page + 1)
        self.verify_slots.fill_(DUMMY_SLOT)
        self.state_slots.fill_(DUMMY_SLOT)
        self.context_lens.fill_(1)
        self.seq_lens.fill_(2)
        self.draft_context.fill_(1)
        self.draft_seq_lens.fill_(2)
        self.block_tables.fill_(DUMMY_PAGE)

    # ---- capture ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures every graph (largest bucket first: later graphs reuse its pool memory)."""
        started = time.monotonic()
        self._reset_padding()
        model, caches = self.model, self.caches
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for rows in reversed(self.buckets):
                for k in range(self.max_drafts, 0, -1):
                    batch = self._verify_batch(rows, k)
                    n = rows * (k + 1)

                    def verify(batch: ForwardBatch = batch) -> tuple[torch.Tensor, ...]:
                        hidden = model(batch, caches.kv, caches.states, every_token=True)
                        return hidden, model.compute_logits(hidden, out=self.verify_logits)

                    def mtp(batch: ForwardBatch = batch, n: int = n) -> tuple[torch.Tensor, ...]:
                        return (
                            model.mtp_forward(self.mtp_ids[:n], self.mtp_hidden_in[:n], batch, caches.kv),
                        )

                    self.verify_graphs[(rows, k)] = self._capture(verify, stream)
                    self.mtp_graphs[(rows, k)] = self._capture(mtp, stream)
                    self.greedy_graphs[(rows, k)] = self._capture(
                        lambda rows=rows, k=k: (self._greedy_chain(rows, k),), stream
                    )
                draft_batch = self._draft_batch(rows)

                def draft(batch: ForwardBatch = draft_batch, rows: int = rows) -> tuple[torch.Tensor, ...]:
                    hidden = model.mtp_forward(
                        self.draft_tokens[:rows], self.draft_hidden[:rows], batch, caches.kv
                    )
                    return hidden, model.draft_tokens(hidden)

                self.draft_graphs[rows] = self._capture(draft, stream)
                single_batch = self._single_batch(rows)

                def single_mtp(
                    batch: ForwardBatch = single_batch, rows: int = rows
                ) -> tuple[torch.Tensor, ...]:
                    return (
                        model.mtp_forward(self.mtp_ids[:rows], self.mtp_hidden_in[:rows], batch, caches.kv),
                    )

                self.single_mtp_graphs[rows] = self._capture(single_mtp, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self._reset_padding()
        return time.monotonic() - started

    def _greedy_chain(self, rows: int, k: int) -> torch.Tensor:
        """The whole greedy speculative step over the static verify inputs (captured, never run
        outside a capture but for its warm-up). Returns [rows, (k + 1) + 1 + k] int64: each row's
        targets after its k + 1 positions, its accepted drafts, its k new proposals."""
        model, caches, page = self.model, self.caches, self.caches.page_size
        t = k + 1
        batch = self._verify_batch(rows, k)
        hidden = model(batch, caches.kv, caches.states, every_token=True)
        targets = model.compute_logits(hidden).argmax(dim=-1)  # [rows * t]
        by_row = targets.view(rows, t)
        drafts = self.tokens[: rows * t].view(rows, t)[:, 1:]
        positions = torch.arange(k, device=self.device)
        matches = ((drafts == by_row[:, :k]) | self.force_accept) & (
            positions[None, :] < self.accept_limits[:rows, None]
        )
        accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [rows]
        # The state after the last accepted token: its scratch slot, or the row's own (all accepted).
        src = self.verify_slots[: rows * t].view(rows, t).gather(1, accepted[:, None])[:, 0]
        dst = self.state_slots[:rows]
        states = caches.states
        states.conv[:, dst] = states.conv[:, src]
        states.ssm[:, dst] = states.ssm[:, src]
        # The MTP's input at position i is the token after it: an accepted draft (the target's token
        # unless acceptance is forced), then the target's.
        taken = torch.arange(t, device=self.device)[None, :] < accepted[:, None]
        after = torch.cat([drafts, by_row[:, k:]], dim=1)
        next_ids = torch.where(taken, after, by_row).reshape(-1)
        mtp_hidden = model.mtp_forward(next_ids, hidden, batch, caches.kv).view(rows, t, -1)
        last = mtp_hidden[torch.arange(rows, device=self.device), accepted]  # [rows, H]
        token = model.draft_tokens(last)
        proposals = [token]
        committed = self.context_lens[:rows].long() + accepted + 1
        tables = self.block_tables[:rows].long()
        for j in range(1, k):
            pos = committed + j - 1
            page_ids = tables.gather(1, (pos // page)[:, None])[:, 0]
            step = ForwardBatch(
                input_ids=token,
                positions=pos,
                query_start_loc=self.query_starts[0][: rows + 1],
                context_lens=pos.int(),
                seq_lens=(pos + 1).int(),
                block_tables=self.block_tables[:rows],
                slot_mapping=page_ids * page + pos % page,
                state_slots=self.state_slots[:rows],
                logits_indices=self.logits_indices[:rows],
                num_decodes=rows,
                query_lens_host=(1,) * rows,
                context_lens_host=(1,) * rows,
            )
            last = model.mtp_forward(token, last, step, caches.kv)
            token = model.draft_tokens(last)
            proposals.append(token)
        return torch.cat([by_row, accepted[:, None], torch.stack(proposals, dim=1)], dim=1)

    def _capture(self, fn, stream: torch.cuda.Stream) -> _Captured:
        for _ in range(2):  # compile/warm every kernel at this shape outside the capture
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            outputs = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return _Captured(graph, outputs)

    # ---- replay ----------------------------------------------------------------------------------

    def can_run(self, rows: Sequence[BatchRow]) -> bool:
        if not rows or len(rows) > self.max_rows:
            return False
        t = len(rows[0].token_ids)
        return (
            2 <= t <= self.max_drafts + 1
            and all(len(r.token_ids) == t and len(r.state_after) == t - 1 and not r.scored for r in rows)
            and all(len(r.pages) <= self.max_pages for r in rows)
        )

    def can_run_single(self, rows: Sequence[BatchRow]) -> bool:
        """`mtp_single` can take the rows: one token each, unscored, at most the largest bucket."""
        return self.can_draft(rows) and all(
            len(r.token_ids) == 1 and not r.state_after and not r.scored for r in rows
        )

    def can_draft(self, rows: Sequence[BatchRow]) -> bool:
        """The draft graphs can take the rows (`load_tables` first when no verify replay filled them)."""
        return 0 < len(rows) <= self.max_rows and all(len(r.pages) <= self.max_pages for r in rows)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    @torch.inference_mode()
    def verify(self, rows: Sequence[BatchRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [n(k+1), H], logits [n(k+1), V]) of every token of the rows; the logits are a view
        of the shared buffer, which the next verify replay overwrites."""
        n, t = len(rows), len(rows[0].token_ids)
        bucket = self.bucket(n)
        self._fill_verify(rows, bucket)
        captured = self.verify_graphs[(bucket, t - 1)]
        captured.graph.replay()
        hidden, logits = captured.outputs
        return hidden[: n * t], logits[: n * t]

    def _fill_verify(self, rows: Sequence[BatchRow], bucket: int, accept_limits: Sequence[int] = ()) -> None:
        """The verify rows' inputs into the static buffers (padding rows from len(rows) to bucket)."""
        self._copied.synchronize()  # the previous step's inputs have left the host twins
        fill_verify_inputs(
            self._longs_host.numpy(),
            self._ints_host.numpy(),
            rows,
            bucket,
            self.caches.page_size,
            self.max_rows,
            accept_limits,
        )
        self._longs.copy_(self._longs_host, non_blocking=True)
        ints = 2 * self.max_rows + bucket * self.max_pages
        self._ints[:ints].copy_(self._ints_host[:ints], non_blocking=True)
        self._copied.record()

    @torch.inference_mode()
    def greedy_step(
        self, rows: Sequence[BatchRow], accept_limits: Sequence[int], force_accept: bool = False
    ) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """The whole step for greedy rows in one replay: per row its targets after each position, its
        accepted drafts (at most accept_limits[i]; exactly that many when forced, benchmark only) and
        its k new proposals. The state of each row's last accepted token is committed in the replay."""
        n, t = len(rows), len(rows[0].token_ids)
        bucket = self.bucket(n)
        self._fill_verify(rows, bucket, accept_limits)
        self.force_accept.fill_(force_accept)
        captured = self.greedy_graphs[(bucket, t - 1)]
        captured.graph.replay()
        out = captured.outputs[0][:n].tolist()
        return [r[:t] for r in out], [r[t] for r in out], [r[t + 1 :] for r in out]

    @torch.inference_mode()
    def mtp(self, rows: int, k: int, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head over the last verify replay's tokens: ids [n(k+1)] (the next token of each), the
        target's hidden [n(k+1), H]. Returns the MTP hidden [n(k+1), H]."""
        m = ids.shape[0]
        self.mtp_ids[:m].copy_(ids)
        self.mtp_hidden_in[:m].copy_(hidden)
        captured = self.mtp_graphs[(self.bucket(rows), k)]
        captured.graph.replay()
        return captured.outputs[0][:m]

    @torch.inference_mode()
    def mtp_single(self, rows: Sequence[BatchRow], ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head over rows of one token each (`can_run_single`) whose target forward ran elsewhere:
        ids [n] the next token of each, hidden [n, H] the target's. Returns the MTP hidden [n, H]; the
        rows' block tables stay loaded for `draft`."""
        n = len(rows)
        bucket = self.bucket(n)
        self._fill_verify(rows, bucket)
        self.mtp_ids[:n].copy_(ids)
        self.mtp_hidden_in[:n].copy_(hidden)
        captured = self.single_mtp_graphs[bucket]
        captured.graph.replay()
        return captured.outputs[0][:n]

    def load_tables(self, rows: Sequence[BatchRow]) -> None:
        """The rows' block tables (`can_draft`) for `draft` after a step no verify replay ran."""
        bucket = self.bucket(len(rows))
        m, p = self.max_rows, self.max_pages
        self._copied.synchronize()
        ints = self._ints_host.numpy()
        fill_block_tables(ints[2 * m : 2 * m + bucket * p].reshape(bucket, p), rows, self.caches.page_size, 0)
        self._ints[2 * m : 2 * m + bucket * p].copy_(
            self._ints_host[2 * m : 2 * m + bucket * p], non_blocking=True
        )
        self._copied.record()

    @torch.inference_mode()
    def draft(
        self, rows: Sequence[BatchRow], tokens: torch.Tensor, hidden: torch.Tensor, positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft step: row i's token at positions[i] (its pages as in the last verify replay,
        `mtp_single` or `load_tables`), over the previous step's MTP hidden. Returns (hidden [n, H],
        greedy draft [n])."""
        n = len(rows)
        bucket = self.bucket(n)
        page = self.caches.page_size
        if bucket > n:
            self.draft_tokens[n:bucket].zero_()
            self.draft_positions[n:bucket].fill_(1)
            self.draft_slot_mapping[n:bucket].fill_(DUMMY_PAGE * page + 1)
            self.draft_context[n:bucket].fill_(1)
            self.draft_seq_lens[n:bucket].fill_(2)
        self.draft_tokens[:n].copy_(tokens)
        self.draft_hidden[:n].copy_(hidden)
        _put(self.draft_positions, list(positions))
        _put(
            self.draft_slot_mapping,
            [kv_slot(r.pages, p, page) for r, p in zip(rows, positions, strict=True)],
        )
        _put(self.draft_context, list(positions))
        _put(self.draft_seq_lens, [p + 1 for p in positions])
        captured = self.draft_graphs[bucket]
        captured.graph.replay()
        out_hidden, out_tokens = captured.outputs
        return out_hidden[:n], out_tokens[:n]


def _put(dst: torch.Tensor, values: list[int]) -> None:
    """Host values into the front of a static device buffer (one pinned, asynchronous copy)."""
    if values:
        src = torch.tensor(values, dtype=dst.dtype).pin_memory()
        dst[: len(values)].copy_(src, non_blocking=True)
