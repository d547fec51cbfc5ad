"""How much of the fused-MoE kernels' time at saturated step sizes is padding: uniform random routing
against balanced routing (every expert exactly T*k/E rows), default tiles and 64-row tiles."""
import torch, triton, triton.testing
from deltaserve.ops.triton.moe import fused_experts, default_tiles, MoeTiles

E, K, H, I = 256, 8, 2048, 512
dev = "cuda"
torch.manual_seed(0)
w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
MED = MoeTiles(64, 64, 64, 4, 3)
LARGE = MoeTiles(128, 128, 64, 8, 3)
print(f"{'T':>6} {'routing':>9} {'tiles':>6} {'ms':>8} {'padded/real':>11} {'real TFLOP/s':>12} {'issued TFLOP/s':>14}")
for T in (2048, 2560, 4096, 4608, 5120, 8192):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    weights = torch.rand(T, K, device=dev, dtype=torch.bfloat16)
    uniform = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    balanced = (torch.arange(T * K, device=dev) % E).reshape(T, K)
    # skewed: a Zipf-like preference, as trained routers show
    pref = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float32) ** 0.5
    skewed = (torch.rand(T, E, device=dev).log() / pref[torch.randperm(E, device=dev)]).topk(K, dim=1).indices
    for name, ids in (("uniform", uniform), ("balanced", balanced), ("skewed", skewed)):
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        for tname, tiles in (("large", LARGE), ("medium", MED)):
            bm = tiles.block_m
            padded = int(((counts + bm - 1) // bm * bm).sum())
            fn = lambda: fused_experts(x, w13, w2, weights, ids, tiles=tiles)
            fn(); torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            real = 2 * T * K * 3 * H * I
            print(f"{T:>6} {name:>9} {tname:>6} {ms:8.4f} {padded / (T * K):11.3f} {real / ms / 1e9:12.1f} {real * padded / (T * K) / ms / 1e9:14.1f}")
