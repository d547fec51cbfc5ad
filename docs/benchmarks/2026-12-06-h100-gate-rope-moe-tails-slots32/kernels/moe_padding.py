"""How much of the fused-MoE kernels' time at saturated step sizes is padding: uniform random routing
against balanced routing (every expert exactly T*k/E rows), default tiles and 64-row tiles (35B-A3B
experts: 256, 8 per token, hidden 2048, expert 512). Run from the repository root on a CUDA GPU."""

import torch
import triton.testing

from deltaserve.ops.triton.moe import MoeTiles, fused_experts

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
TILES = (("large", MoeTiles(128, 128, 64, 8, 3)), ("medium", MoeTiles(64, 64, 64, 4, 3)))


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.02
    print(
        f"{'T':>6} {'routing':>9} {'tiles':>6} {'ms':>8} {'padded/real':>11} {'real TFLOP/s':>12} {'issued TFLOP/s':>14}"
    )
    for tokens in (2048, 2560, 4096, 4608, 5120, 8192):
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
        weights = torch.rand(tokens, TOP_K, device=dev, dtype=torch.bfloat16)
        uniform = torch.rand(tokens, EXPERTS, device=dev).topk(TOP_K, dim=1).indices
        balanced = (torch.arange(tokens * TOP_K, device=dev) % EXPERTS).reshape(tokens, TOP_K)
        # skewed: a Zipf-like preference, as trained routers show
        pref = 1.0 / torch.arange(1, EXPERTS + 1, device=dev, dtype=torch.float32) ** 0.5
        keys = torch.rand(tokens, EXPERTS, device=dev).log() / pref[torch.randperm(EXPERTS, device=dev)]
        skewed = keys.topk(TOP_K, dim=1).indices
        for name, ids in (("uniform", uniform), ("balanced", balanced), ("skewed", skewed)):
            counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
            for tiles_name, tiles in TILES:
                bm = tiles.block_m
                padded = int(((counts + bm - 1) // bm * bm).sum())
                args = (x, w13, w2, weights, ids)
                fused_experts(*args, tiles=tiles)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(
                    lambda a=args, t=tiles: fused_experts(*a, tiles=t), warmup=50, rep=300
                )
                real = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
                share = padded / (tokens * TOP_K)
                print(
                    f"{tokens:>6} {name:>9} {tiles_name:>6} {ms:8.4f} {share:11.3f} {real / ms / 1e9:12.1f}"
                    f" {real * share / ms / 1e9:14.1f}"
                )


if __name__ == "__main__":
    main()
