"""The fused-MoE kernels at saturated step sizes (35B-A3B experts): 32/64-row tail tiles against none,
uniform and skewed routing; padded rows per real row; max |diff| against the tail-free kernels."""
import torch, triton, triton.testing
from deltaserve.ops.triton.moe import fused_experts, MoeTiles

E, K, H, I = 256, 8, 2048, 512
dev = "cuda"
torch.manual_seed(0)
w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
CONFIGS = [("large", MoeTiles(128, 128, 64, 8, 3)), ("large t32", MoeTiles(128, 128, 64, 8, 3, 32)),
           ("large t64", MoeTiles(128, 128, 64, 8, 3, 64)), ("medium", MoeTiles(64, 64, 64, 4, 3)),
           ("medium t16", MoeTiles(64, 64, 64, 4, 3, 16)), ("medium t32", MoeTiles(64, 64, 64, 4, 3, 32))]
x0 = torch.randn(8192, H, device=dev, dtype=torch.bfloat16)
for _ in range(30):
    fused_experts(x0, w13, w2, torch.rand(8192, K, device=dev, dtype=torch.bfloat16), torch.rand(8192, E, device=dev).topk(K, dim=1).indices)
torch.cuda.synchronize()
print(f"{'T':>6} {'routing':>8} {'tiles':>11} {'ms':>8} {'vs no tail':>10} {'padded/real':>11} {'TFLOP/s':>8} {'max|diff|':>9}")
for T in (2048, 2560, 4096, 4608, 5120, 8192):
    x = x0[:T].contiguous()
    weights = torch.rand(T, K, device=dev, dtype=torch.bfloat16)
    uniform = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    pref = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float32) ** 0.5
    skewed = (torch.rand(T, E, device=dev).log() / pref[torch.randperm(E, device=dev)]).topk(K, dim=1).indices
    for name, ids in (("uniform", uniform), ("skewed", skewed)):
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        base = {}
        for tname, tiles in CONFIGS:
            bm, tail = tiles.block_m, tiles.tail_m
            full = counts // bm * bm
            rem = counts - full
            padded = int(full.sum() + torch.where(rem == 0, 0, torch.where((rem <= tail) if tail else torch.zeros_like(rem, dtype=torch.bool), tail, bm)).sum())
            out = fused_experts(x, w13, w2, weights, ids, tiles=tiles)
            ms = triton.testing.do_bench(lambda: fused_experts(x, w13, w2, weights, ids, tiles=tiles), warmup=50, rep=300)
            fam = tname.split()[0]
            if fam not in base:
                base[fam] = (ms, out)
            diff = (out.float() - base[fam][1].float()).abs().max().item()
            real = 2 * T * K * 3 * H * I
            print(f"{T:>6} {name:>8} {tname:>11} {ms:8.4f} {base[fam][0] / ms:9.3f}x {padded / (T * K):11.3f} {real / ms / 1e9:8.1f} {diff:9.2g}")
