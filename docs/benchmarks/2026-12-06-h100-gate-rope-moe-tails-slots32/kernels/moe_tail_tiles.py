"""The fused-MoE kernels at saturated step sizes (35B-A3B experts): 32/64-row tail tiles against none,
uniform and skewed routing; padded rows per real row; max |diff| against the tail-free kernels. Needs
the tree of ef8f4c1 (MoeTiles.tail_m; reverted since). Run from the repository root on a CUDA GPU."""

import torch
import triton.testing

from deltaserve.ops.triton.moe import MoeTiles, fused_experts

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
CONFIGS = [
    ("large", MoeTiles(128, 128, 64, 8, 3)),
    ("large t32", MoeTiles(128, 128, 64, 8, 3, 32)),
    ("large t64", MoeTiles(128, 128, 64, 8, 3, 64)),
    ("medium", MoeTiles(64, 64, 64, 4, 3)),
    ("medium t16", MoeTiles(64, 64, 64, 4, 3, 16)),
    ("medium t32", MoeTiles(64, 64, 64, 4, 3, 32)),
]


def issued_rows(counts: torch.Tensor, tiles: MoeTiles) -> int:
    """Rows the tiles compute: whole blocks, an expert's last block as a tail tile where it fits one."""
    full = counts // tiles.block_m * tiles.block_m
    rest = counts - full
    tail = tiles.tail_m
    last = torch.where(rest == 0, 0, torch.where((rest <= tail) & (tail > 0), tail, tiles.block_m))
    return int(full.sum() + last.sum())


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.02
    x0 = torch.randn(8192, HIDDEN, device=dev, dtype=torch.bfloat16)
    for _ in range(30):  # clocks up before anything is timed
        ids = torch.rand(8192, EXPERTS, device=dev).topk(TOP_K, dim=1).indices
        fused_experts(x0, w13, w2, torch.rand(8192, TOP_K, device=dev, dtype=torch.bfloat16), ids)
    torch.cuda.synchronize()
    print(
        f"{'T':>6} {'routing':>8} {'tiles':>11} {'ms':>8} {'vs no tail':>10} {'padded/real':>11} {'TFLOP/s':>8} {'max|diff|':>9}"
    )
    for tokens in (2048, 2560, 4096, 4608, 5120, 8192):
        x = x0[:tokens].contiguous()
        weights = torch.rand(tokens, TOP_K, device=dev, dtype=torch.bfloat16)
        uniform = torch.rand(tokens, EXPERTS, device=dev).topk(TOP_K, dim=1).indices
        pref = 1.0 / torch.arange(1, EXPERTS + 1, device=dev, dtype=torch.float32) ** 0.5
        keys = torch.rand(tokens, EXPERTS, device=dev).log() / pref[torch.randperm(EXPERTS, device=dev)]
        skewed = keys.topk(TOP_K, dim=1).indices
        for name, ids in (("uniform", uniform), ("skewed", skewed)):
            counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
            base = {}
            for tiles_name, tiles in CONFIGS:
                args = (x, w13, w2, weights, ids)
                out = fused_experts(*args, tiles=tiles)
                ms = triton.testing.do_bench(
                    lambda a=args, t=tiles: fused_experts(*a, tiles=t), warmup=50, rep=300
                )
                family = tiles_name.split()[0]
                base.setdefault(family, (ms, out))
                diff = (out.float() - base[family][1].float()).abs().max().item()
                real = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
                share = issued_rows(counts, tiles) / (tokens * TOP_K)
                print(
                    f"{tokens:>6} {name:>8} {tiles_name:>11} {ms:8.4f} {base[family][0] / ms:9.3f}x {share:11.3f}"
                    f" {real / ms / 1e9:8.1f} {diff:9.2g}"
                )


if __name__ == "__main__":
    main()
