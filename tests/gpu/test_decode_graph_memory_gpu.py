"""The decode graphs share one logits buffer: after capturing every bucket up to 64 sequences (11
graphs, 295 rows in all) they hold about one buffer of 64 rows, not a buffer per bucket; and a replay
of each bucket gives the eager forward's logits for its rows. Above 64 rows a bucket is captured on its
first use or while idle (largest first), and replays what eager computes."""

from __future__ import annotations

import torch
from scheduler_harness import load_model

from deltaserve.cache.device import DeviceCaches, build_device_caches
from deltaserve.engine.cuda_graphs import CudaGraphRunner, graph_buckets, logits_buffer_bytes
from deltaserve.engine.worker import ModelWorker
from deltaserve.ops.batch import BatchRow
from deltaserve.tiny import default_model_dir

DEVICE = torch.device("cuda")
SEQS, PAGE = 64, 16
# The captures' stream gets a cuBLAS workspace of its own from the allocator (Hopper's default
# CUBLAS_WORKSPACE_CONFIG, :4096:8): measured 32 MiB + 5 KiB beside the logits buffer on an H100.
CUBLAS_STREAM_WORKSPACE = 32 * 2**20


def model_and_caches(seqs: int):
    """The tiny model and a pool of two pages and one slot per sequence (plus the reserved ones)."""
    model = load_model(default_model_dir(), device=DEVICE)
    caches = build_device_caches(
        model.config,
        num_pages=2 * seqs + 1,
        page_size=PAGE,
        num_slots=seqs + 1,
        dtype=torch.float32,
        device=DEVICE,
    )
    return model, caches


def prefill_one_token_each(eager: ModelWorker, caches: DeviceCaches, rows: int) -> None:
    """Slots 1..rows from zero states, one prompt token each, in one batch."""
    caches.clear_states(list(range(1, rows + 1)))
    eager.run([BatchRow([i + 1], 0, [i + 1], i + 1) for i in range(rows)])


def test_every_bucket_replays_into_one_shared_logits_buffer():
    model, caches = model_and_caches(SEQS)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(DEVICE)
    graphs = CudaGraphRunner(model, caches, max_num_seqs=SEQS, max_model_len=2 * PAGE)
    graphs.capture()
    held = torch.cuda.memory_allocated(DEVICE) - before
    vocab = model.logits_vocab_size
    one = logits_buffer_bytes(SEQS, vocab)
    per_bucket = sum(logits_buffer_bytes(b, vocab) for b in graph_buckets(SEQS))
    # per bucket it would be 4.6x one
    assert one <= held < 1.5 * one + CUBLAS_STREAM_WORKSPACE, (held, one, per_bucket)

    eager = ModelWorker(model, caches)
    for bucket in graph_buckets(SEQS):
        rows = [BatchRow([7], 1, [i + 1], i + 1) for i in range(bucket)]
        # Both sides start from states prefilled in one batch of the bucket's rows: a prefill's rounding
        # depends on the batch around each row (its GEMMs' kernels and fla's tf32 dots), so states
        # prefilled in another batch would differ by more than the graph does.
        prefill_one_token_each(eager, caches, bucket)
        got = graphs.run(rows).clone()
        prefill_one_token_each(eager, caches, bucket)
        torch.testing.assert_close(got, eager.run(rows)[0], rtol=1e-4, atol=1e-4)


def test_buckets_above_64_rows_are_captured_on_first_use_or_while_idle_and_replay_what_eager_computes():
    seqs = 128
    model, caches = model_and_caches(seqs)
    graphs = CudaGraphRunner(model, caches, max_num_seqs=seqs, max_model_len=2 * PAGE)
    graphs.capture()
    assert sorted(graphs.graphs) == [b for b in graph_buckets(seqs) if b <= 64]
    eager = ModelWorker(model, caches)
    rows = [BatchRow([7], 1, [i + 1], i + 1) for i in range(90)]  # bucket 96: captured on first use
    prefill_one_token_each(eager, caches, 90)
    got = graphs.run(rows).clone()
    assert 96 in graphs.graphs and not graphs.failed
    prefill_one_token_each(eager, caches, 90)
    torch.testing.assert_close(got, eager.run(rows)[0], rtol=1e-4, atol=1e-4)
    captured = []
    before = set(graphs.graphs)
    while graphs.capture_ahead():
        [new] = set(graphs.graphs) - before
        captured.append(new)
        before.add(new)
    assert captured == [128, 120, 112, 104, 88, 80, 72] and graphs.ahead_done
    assert sorted(graphs.graphs) == graph_buckets(seqs)
