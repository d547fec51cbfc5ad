"""The grouping kernels against the former torch ops (kept here as `old`), in CUDA graphs, at the 35B-A3B
routing shape: microseconds per call. python3 groupbench.py (needs CUDA)."""

import torch

from deltaserve.ops.triton import moe as tri


def old(ids, num_experts, block_m):
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
    ss = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    ss.scatter_(0, pad_start[expert] + rank, order.to(torch.int32))
    be = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True).to(torch.int32)
    return ss, be


E, K = 256, 8
print(f"{'T':>6} {'block_m':>7} {'old us':>8} {'new us':>8} {'same':>5}")
for T in (1, 64, 256, 512, 2048, 8192):
    bm = tri.default_tiles(T, K, E, torch.bfloat16).block_m
    logits = torch.randn(T, E, device="cuda")
    ids = torch.topk(logits, K, dim=1).indices
    new = tri._group_slots(ids, E, bm)
    ref = old(ids, E, bm)
    same = torch.equal(new.sorted_slots, ref[0]) and torch.equal(new.block_expert, ref[1])
    res = []
    for fn in (old, lambda i, e, b: tri._group_slots(i, e, b)):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn(ids, E, bm)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(40):
                fn(ids, E, bm)
        g.replay()
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(10):
            g.replay()
        en.record()
        torch.cuda.synchronize()
        res.append(st.elapsed_time(en) / 400 * 1000)
    print(f"{T:>6} {bm:>7} {res[0]:>8.1f} {res[1]:>8.1f} {str(same):>5}")
