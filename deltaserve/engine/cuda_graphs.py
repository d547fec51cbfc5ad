"""CUDA-graph decode (GPU only): one graph per batch bucket over static input buffers.

Graphs cover batch buckets up to --max-num-seqs. Those of at most STARTUP_ROWS rows are captured at
start-up, once the KV pool is sized; the larger ones (24 of the 35 at 512 sequences, ~1.6 s of a 4B
start on an H200) while the engine is idle, largest first, or on the first step that needs one,
whichever comes first: a step waits for at most its own bucket's capture. A bucket whose capture failed
(out of memory) runs its steps as a prefill graph or eagerly. Under tensor parallelism every rank
captures the same bucket at the same step, and a failure on any rank fails it on all (`agree`).
Padding rows (bucket > live rows) point at the reserved KV page 0 and the reserved state slot 0, so
they never touch a live sequence.

Every graph writes its float32 logits into the front of one output buffer, [max_num_seqs, vocab]: an
output of each graph's own would stay allocated for the life of the graphs, ~1 MB per row for each
bucket (5.4 GiB at 512 sequences over Qwen3.5's vocabulary, against 0.5 GiB for the one buffer).
Sharing it is safe because replays run in order on one stream: a step's logits are read by the kernels
launched after its replay (sampler, grammar masks) before the next replay writes them.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Container, Sequence

import numpy as np
import torch

from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.kv_pages import DUMMY_PAGE
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.engine.idle_captures import CapturesAhead
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, ForwardBatch, kv_slot

logger = logging.getLogger(__name__)

# Decode buckets captured at start-up: every row count of a batch-1 to concurrency-64 server.
STARTUP_ROWS = 64


def padded_logits_rows(rows: int, buckets: Sequence[int]) -> int:
    """The row count to run the LM head's GEMM at for `rows` rows outside a decode graph: their bucket
    (none for none: a step of partial prompt chunks reads no LM head; beyond the largest, `rows` itself). A GEMM at a row count that takes a cuBLAS kernel not run before
    in the process loads that kernel (CUDA's lazy loading), which waits for the work queued on the device:
    ~3 ms on an idle H200, ~130 ms behind a step launched ahead (the 9B's LM head at 129, 140, 160...
    rows), a stall for every decoder. The warm-up runs every bucket's GEMM (engine/warmup.py)."""
    if rows == 0:
        return 0
    return next((b for b in buckets if b >= rows), rows)


def logits_buffer_bytes(rows: int, vocab: int) -> int:
    """Device memory of a graph runner's shared logits buffer: float32 [rows, vocab]."""
    return rows * vocab * 4


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 (16 past 128, 32 past 256) up to max_num_seqs (always included)."""
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    b = 8
    while b < max_num_seqs:
        buckets.append(b)
        b += 8 if b < 128 else 16 if b < 256 else 32
    buckets.append(max_num_seqs)
    return buckets


def startup_buckets(buckets: Sequence[int], startup_rows: int = STARTUP_ROWS) -> list[int]:
    """The buckets captured at start-up: those of at most `startup_rows` rows (the smallest at least)."""
    return [b for b in buckets if b <= startup_rows] or list(buckets[:1])


def next_ahead(buckets: Sequence[int], settled: Container[int]) -> int | None:
    """The bucket an idle tick captures next: the largest not captured (or failed) yet, so that the
    smaller ones reuse its memory in the graph pool, as start-up's largest-first order does."""
    return next((b for b in reversed(buckets) if b not in settled), None)


def fill_decode_inputs(
    longs: np.ndarray, ints: np.ndarray, rows: Sequence[BatchRow], bucket: int, page_size: int
) -> None:
    """Writes a decode graph's inputs for `rows` padded to `bucket` rows. longs [4, M] int64: token id,
    position (= context), state slot, KV slot (page * page_size + offset) per row. ints [2M + M*P]
    int32: context lengths [M], sequence lengths [M], then the block table [M, P] row-major (only its
    first `bucket` rows are written). Padding rows hold one token at position 1 of the reserved page,
    with the reserved state slot, so they never touch a live sequence."""
    m = longs.shape[1]
    n = len(rows)
    max_pages = (ints.shape[0] - 2 * m) // m
    ctx = [r.context_len for r in rows]
    longs[0, :n] = [r.token_ids[0] for r in rows]
    longs[1, :n] = ctx
    longs[2, :n] = [r.state_slot for r in rows]
    longs[3, :n] = [kv_slot(r.pages, c, page_size) for r, c in zip(rows, ctx, strict=True)]
    ints[:n] = ctx
    ints[m : m + n] = longs[1, :n] + 1
    tables = ints[2 * m : 2 * m + bucket * max_pages].reshape(bucket, max_pages)
    for i, r in enumerate(rows):
        # Columns past a row's pages keep stale ids: attention never reads past its seq_len.
        tables[i, : len(r.pages)] = r.pages
    longs[:, n:bucket] = [[0], [1], [DUMMY_SLOT], [DUMMY_PAGE * page_size + 1]]
    ints[n:bucket] = 1
    ints[m + n : m + bucket] = 2
    tables[n:bucket, 0] = DUMMY_PAGE


def decode_batch_over(
    rows: int,
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    state_slots: torch.Tensor,
    logits_indices: torch.Tensor,
) -> ForwardBatch:
    """`rows` decode rows (one token each) over the front of a graph's static buffers."""
    return ForwardBatch(
        input_ids=input_ids[:rows],
        positions=positions[:rows],
        query_start_loc=query_start_loc[: rows + 1],
        context_lens=context_lens[:rows],
        seq_lens=seq_lens[:rows],
        block_tables=block_tables[:rows],
        slot_mapping=slot_mapping[:rows],
        state_slots=state_slots[:rows],
        logits_indices=logits_indices[:rows],
        num_decodes=rows,
        query_lens_host=(1,) * rows,
        context_lens_host=(1,) * rows,  # never read on the GPU decode path
    )


class CudaGraphRunner:
    """Replays captured decode forwards. `run(rows)` takes one-token rows (decode rows, and one-token
    prompts at context 0) and returns float32 logits [len(rows), vocab], a view of the shared buffer
    that the next replay overwrites; the caller advances the caches as usual."""

    def __init__(
        self,
        model: Qwen35ForCausalLM,
        cache: DeviceCaches,
        max_num_seqs: int,
        max_model_len: int,
        *,
        capture_error_mode: str = "global",
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        """`capture_error_mode`: torch.cuda.graph's at start-up; "thread_local" under tensor parallelism
        (engine/tp.py) and for every later capture (serving threads may touch the device meanwhile).
        `agree`: tensor parallelism, whether every rank's capture of a bucket succeeded."""
        self.model = model
        self.cache = cache
        self.capture_error_mode = capture_error_mode
        self.agree = agree
        self.device = model.device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_rows = self.buckets[-1]
        self.max_pages = -(-max_model_len // cache.page_size)
        if cache.states.capacity < max_num_seqs:
            raise ValueError(
                f"the state pool holds {cache.states.capacity} slots, fewer than the largest decode graph "
                f"bucket ({max_num_seqs}); every captured row needs its own slot"
            )
        n, dev = self.max_rows, self.device
        # Inputs live in two device buffers (int64 rows; int32 lengths + block table) with pinned host
        # twins, so a replay's inputs go over in two copies. The named tensors are views into them.
        self._longs = torch.zeros(4, n, dtype=torch.int64, device=dev)
        self._ints = torch.zeros(2 * n + n * self.max_pages, dtype=torch.int32, device=dev)
        self._longs_host = torch.zeros(4, n, dtype=torch.int64).pin_memory()
        self._ints_host = torch.zeros(self._ints.shape, dtype=torch.int32).pin_memory()
        self._copied = torch.cuda.Event()  # the host twins may be rewritten once this has passed
        self.input_ids, self.positions, self.state_slots, self.slot_mapping = self._longs.unbind(0)
        self.context_lens = self._ints[:n]
        self.seq_lens = self._ints[n : 2 * n]
        self.block_tables = self._ints[2 * n :].view(n, self.max_pages)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.logits = torch.empty(n, model.logits_vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: set[int] = set()  # buckets whose capture failed: their steps run without
        self.pool = None
        self._stream: torch.cuda.Stream | None = None
        self._ahead = CapturesAhead(
            "decode graphs",
            lambda: next_ahead(self.buckets, self.graphs.keys() | self.failed),
            lambda rows: self._capture(rows, why="while idle"),
            lambda: f"{len(self.graphs)} of {len(self.buckets)} buckets captured",
        )

    def _batch(self, rows: int) -> ForwardBatch:
        return decode_batch_over(
            rows,
            input_ids=self.input_ids,
            positions=self.positions,
            query_start_loc=self.query_start_loc,
            context_lens=self.context_lens,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            state_slots=self.state_slots,
            logits_indices=self.logits_indices,
        )

    def _reset_padding(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.context_lens.fill_(1)
        self.seq_lens.fill_(1)
        self.block_tables.fill_(DUMMY_PAGE)
        self.slot_mapping.fill_(DUMMY_PAGE * self.cache.page_size)
        self.state_slots.fill_(DUMMY_SLOT)

    @torch.inference_mode()
    def capture(self) -> float:
        """Start-up: captures the buckets of `startup_buckets`, largest first (the smaller ones reuse its
        pool memory). Returns the seconds taken."""
        started = time.monotonic()
        for rows in reversed(startup_buckets(self.buckets)):
            self._capture(rows, why="")
        torch.cuda.synchronize(self.device)
        return time.monotonic() - started

    @property
    def ahead_done(self) -> bool:
        """Whether `capture_ahead` has found nothing left to capture."""
        return self._ahead.done

    @torch.inference_mode()
    def capture_ahead(self) -> bool:
        """Idle time: captures the next bucket of `next_ahead`; False when none is left."""
        return self._ahead.step()

    def _capture(self, rows: int, *, why: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Captures bucket `rows` over padding inputs, two eager forwards first (they load every kernel
        at this shape); None when it failed here or, with `agree`, on another rank: the bucket's steps
        then run without it. `why`: empty at start-up, where a failure raises (and every rank captures
        the same buckets without agreeing on each), else what the log line says."""
        error_mode = "thread_local" if why else self.capture_error_mode
        started = time.monotonic()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        current = torch.cuda.current_stream(self.device)
        try:
            self._copied.synchronize()  # a replay's inputs have left the host twins before they change
            self._reset_padding()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                batch = self._batch(rows)
                for _ in range(2):
                    self._forward(batch)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=error_mode):
                    logits = self._forward(batch)
            captured: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = (graph, logits)
        except Exception:  # out of memory, or a kernel that cannot be captured
            if not why:
                raise  # at start-up a bucket that cannot be captured fails the start, naming its error
            logger.warning(
                "decode graph for %d rows not captured; those steps run without", rows, exc_info=True
            )
            captured = None
        current.wait_stream(stream)
        if captured is not None and self.pool is None:
            self.pool = captured[0].pool()
        if why and self.agree is not None and not self.agree(captured is not None):
            if captured is not None:
                logger.warning(
                    "decode graph for %d rows not captured on another rank; those steps run without", rows
                )
            captured = None
        if captured is None:
            self.failed.add(rows)
            return None
        self.graphs[rows] = captured
        if why:
            logger.info(
                "captured the decode graph for %d rows %s in %.0f ms",
                rows,
                why,
                (time.monotonic() - started) * 1e3,
            )
        return captured

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(batch, self.cache.kv, self.cache.states), out=self.logits)

    def bucket(self, rows: int) -> int:
        """The smallest bucket of at least `rows` rows (buckets ascend)."""
        return self.buckets[bisect.bisect_left(self.buckets, rows)]

    def can_run(self, rows: Sequence[BatchRow]) -> bool:
        """One-token rows (decode rows, and one-token prompts: context 0, whose state is cleared) in a
        bucket whose capture has not failed."""
        return (
            0 < len(rows) <= self.max_rows
            and all(len(r.token_ids) == 1 for r in rows)
            and self.bucket(len(rows)) not in self.failed
        )

    @torch.inference_mode()
    def run(self, rows: Sequence[BatchRow], fed: torch.Tensor | None = None) -> torch.Tensor | None:
        """`fed`: input tokens of the first fed.shape[0] rows, on the device (their host token ids are
        placeholders), copied in after the host inputs. A bucket not captured yet is captured first;
        None when that failed (the caller runs the rows another way)."""
        n = len(rows)
        bucket = self.bucket(n)
        if bucket not in self.graphs and self._capture(bucket, why="on first use") is None:
            return None
        page = self.cache.page_size
        self._copied.synchronize()  # the previous replay's inputs have left the host twins
        fill_decode_inputs(self._longs_host.numpy(), self._ints_host.numpy(), rows, bucket, page)
        self._longs.copy_(self._longs_host, non_blocking=True)
        used = 2 * self.max_rows + bucket * self.max_pages
        self._ints[:used].copy_(self._ints_host[:used], non_blocking=True)
        self._copied.record()
        if fed is not None:
            self.input_ids[: fed.shape[0]].copy_(fed)
        # A one-token prompt runs as a decode row from the state before any token (the eager path
        # starts a context-0 row from zeros whatever its slot holds).
        self.cache.clear_states([r.state_slot for r in rows if r.context_len == 0])
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]
