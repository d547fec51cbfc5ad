"""The routing kernel against the torch reference (softmax, top-k, renormalise), in CUDA graphs, at the
35B-A3B router shape: microseconds per call. python3 routebench.py (needs CUDA)."""

import torch

from deltaserve.ops import moe as ref
from deltaserve.ops.triton.routing import route

E, K = 256, 8
print(f"{'T':>6} {'torch us':>9} {'kernel us':>9} {'ids same':>8} {'max dw':>8}")
for T in (1, 256, 512, 2048, 8192):
    logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    w, i = route(logits, K, True)
    rw, ri = ref.route(logits, K, True)
    same = torch.equal(i, ri)
    dw = (w.float() - rw.float()).abs().max().item()
    res = []
    for fn in (ref.route, route):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn(logits, K, True)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(40):
                fn(logits, K, True)
        g.replay()
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(10):
            g.replay()
        en.record()
        torch.cuda.synchronize()
        res.append(st.elapsed_time(en) / 400 * 1000)
    print(f"{T:>6} {res[0]:>9.1f} {res[1]:>9.1f} {str(same):>8} {dw:>8.2g}")
