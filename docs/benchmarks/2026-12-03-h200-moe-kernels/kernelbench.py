"""The MoE grouping and routing kernels against the torch ops they replaced (the grouping's kept here as
`torch_grouping`), in CUDA graphs, at the 35B-A3B's routing shape (256 experts, 8 per token):
microseconds per call. python3 kernelbench.py (needs CUDA); output: groupbench.txt, routebench.txt."""

import torch

from deltaserve.ops import moe as reference
from deltaserve.ops.triton import moe as tri
from deltaserve.ops.triton.routing import route

E, K = 256, 8
TOKENS = (1, 64, 256, 512, 2048, 8192)


def torch_grouping(ids, num_experts, block_m):
    flat = ids.reshape(-1).long()
    num_slots = flat.numel()
    device = flat.device
    num_blocks = tri._max_blocks(num_slots, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    run_start = torch.cumsum(counts, 0) - counts
    pad_start = (block_end - blocks) * block_m
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num_slots, device=device) - run_start[expert]
    slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    slots.scatter_(0, pad_start[expert] + rank, order.to(torch.int32))
    block_ids = torch.arange(num_blocks, device=device)
    return slots, torch.searchsorted(block_end, block_ids, right=True).to(torch.int32)


def us_per_call(fn, *args, calls: int = 40, replays: int = 10) -> float:
    """fn(*args) captured `calls` times in one CUDA graph, replayed `replays` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays) * 1000


print(f"{'T':>6} {'block_m':>7} {'old us':>8} {'new us':>8} {'same':>5}")
for tokens in TOKENS:
    block_m = tri.default_tiles(tokens, K, E, torch.bfloat16).block_m
    ids = torch.topk(torch.randn(tokens, E, device="cuda"), K, dim=1).indices
    new = tri._group_slots(ids, E, block_m)
    old = torch_grouping(ids, E, block_m)
    same = torch.equal(new.sorted_slots, old[0]) and torch.equal(new.block_expert, old[1])
    old_us = us_per_call(torch_grouping, ids, E, block_m)
    new_us = us_per_call(tri._group_slots, ids, E, block_m)
    print(f"{tokens:>6} {block_m:>7} {old_us:>8.1f} {new_us:>8.1f} {str(same):>5}")

print(f"\n{'T':>6} {'torch us':>9} {'kernel us':>9} {'ids same':>8} {'max dw':>8}")
for tokens in TOKENS:
    logits = torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16)
    weights, ids = route(logits, K, True)
    want_weights, want_ids = reference.route(logits, K, True)
    same = torch.equal(ids, want_ids)
    dw = (weights.float() - want_weights.float()).abs().max().item()
    torch_us = us_per_call(reference.route, logits, K, True)
    kernel_us = us_per_call(route, logits, K, True)
    print(f"{tokens:>6} {torch_us:>9.1f} {kernel_us:>9.1f} {str(same):>8} {dw:>8.2g}")
