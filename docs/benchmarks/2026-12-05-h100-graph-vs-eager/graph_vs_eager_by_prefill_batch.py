"""Which part of the decode-graph test's difference is the graph: for each bucket, a graph replay and
an eager step from states prefilled (a) in a batch of the bucket's rows, (b) in one batch of all 64.
Run from the repository root on a GPU:

    python3 docs/benchmarks/2026-12-05-h100-graph-vs-eager/graph_vs_eager_by_prefill_batch.py
"""

import sys

sys.path[:0] = ["tests", "tests/gpu"]

from test_decode_graph_memory_gpu import SEQS, model_and_caches, prefill_one_token_each  # noqa: E402

from deltaserve.engine.cuda_graphs import CudaGraphRunner, graph_buckets  # noqa: E402
from deltaserve.engine.worker import ModelWorker  # noqa: E402
from deltaserve.ops.batch import BatchRow  # noqa: E402

model, caches = model_and_caches(SEQS)
graphs = CudaGraphRunner(model, caches, max_num_seqs=SEQS, max_model_len=32)
graphs.capture()
eager = ModelWorker(model, caches)


def mx(a, b):
    return f"{(a - b).abs().max().item():.2e}"


print(
    "bucket graph-vs-eager(same prefill) graph-vs-eager(64 prefill) eager(bucket)-vs-eager(64) graph(bucket)-vs-graph(64)"
)
for bucket in graph_buckets(SEQS):
    rows = [BatchRow([7], 1, [i + 1], i + 1) for i in range(bucket)]
    prefill_one_token_each(eager, caches, bucket)
    g_same = graphs.run(rows).clone()
    prefill_one_token_each(eager, caches, bucket)
    e_same = eager.run(rows)[0].clone()
    prefill_one_token_each(eager, caches, SEQS)
    g_all = graphs.run(rows).clone()
    prefill_one_token_each(eager, caches, SEQS)
    e_all = eager.run(rows)[0].clone()
    prefill_one_token_each(eager, caches, bucket)
    e_again = eager.run(rows)[0].clone()
    print(
        bucket,
        mx(g_same, e_same),
        mx(g_all, e_all),
        mx(e_same, e_all),
        mx(g_same, g_all),
        "eager-rerun",
        mx(e_same, e_again),
    )
