"""Decode-graph replay against the eager forward, bucket by bucket, as
tests/gpu/test_decode_graph_memory_gpu.py compares them (the embedded tiny model in fp32, 64 sequences,
one token of context): prints each bucket's largest absolute logit difference and how many rows pass
the test's 1e-4 bounds. Run from the repository root on a GPU:

    python3 docs/benchmarks/2026-12-05-h100-gate-and-tests/graph_vs_eager_by_bucket.py
"""

from __future__ import annotations

import sys

sys.path[:0] = ["tests", "tests/gpu"]

from test_decode_graph_memory_gpu import SEQS, model_and_caches  # noqa: E402

from deltaserve.engine.cuda_graphs import CudaGraphRunner, graph_buckets  # noqa: E402
from deltaserve.engine.worker import ModelWorker  # noqa: E402
from deltaserve.ops.batch import BatchRow  # noqa: E402


def prefill(eager: ModelWorker, rows: int) -> None:
    eager.run([BatchRow([i + 1], 0, [i + 1], i + 1) for i in range(rows)])


def main() -> None:
    model, caches = model_and_caches(SEQS)
    graphs = CudaGraphRunner(model, caches, max_num_seqs=SEQS, max_model_len=32)
    graphs.capture()
    eager = ModelWorker(model, caches)
    prefill(eager, SEQS)
    for bucket in graph_buckets(SEQS):
        rows = [BatchRow([7], 1, [i + 1], i + 1) for i in range(bucket)]
        got = graphs.run(rows).clone()
        caches.clear_states([r.state_slot for r in rows])
        prefill(eager, bucket)
        want = eager.run(rows)[0]
        diff = (got - want).abs()
        over = (diff > 1e-4 + 1e-4 * want.abs()).any(-1)
        print(
            f"{bucket} max abs {diff.max().item():.2e} rows over 1e-4 {int(over.sum())} "
            f"worst row {int(diff.max(-1).values.argmax())}"
        )
        caches.clear_states([r.state_slot for r in rows])
        prefill(eager, bucket)


if __name__ == "__main__":
    main()
