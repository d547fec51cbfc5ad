"""Block-size sweep of the fused-MoE kernels on CUDA (ops/triton/moe.py), at a model's expert shape.

For each token count: the default launch parameters (`default_tiles`) against the torch reference
(max |difference|, bf16), then every candidate of SWEEP timed (triton.testing.do_bench, L2 flushed) and
checked against the default's output; a candidate the GPU cannot launch (shared memory) prints n/a.
The TFLOP/s count the routed experts' GEMMs only: 2 * T * k * 3 * H * I.

With --grouped, the Triton kernels at their defaults against the grouped-GEMM path
(deltaserve/ops/triton/moe_grouped.py), eager and replayed from a CUDA graph.

With --descriptors, every candidate also runs with the weights read through TMA tensor descriptors
(`fused_experts(..., descriptors=True)`), on the row after its pointer form; a candidate whose column
tiles do not divide the expert or hidden size prints n/a there.

With --split, each kernel's tiles are swept on their own instead: the down kernel's (n, k, warps, stages)
with gate_up at the default, then gate_up's with down at the default (block_m is the default's: one
grouping serves both).

python3 -m deltaserve.bench.moe_kernel [--shape E,K,H,I] [--tokens 16,256,2048,8192] [--descriptors]
    [--quick | --split | --grouped]
(needs CUDA; the default shape is the 35B-A3B's: 256 experts, 8 per token, hidden 2048, expert 512)
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.testing

from deltaserve.ops import moe as reference
from deltaserve.ops.triton.moe import MoeTiles, default_tiles, fused_experts
from deltaserve.ops.triton.moe_grouped import grouped_experts

DTYPE = torch.bfloat16
SHAPE_35B_A3B = (256, 8, 2048, 512)

# (block_m, block_n, block_k, num_warps, num_stages); the first three are the defaults under 16 rows per
# expert, under 128 and beyond (ops/triton/moe.py).
SWEEP = [
    MoeTiles(16, 64, 64, 4, 3),
    MoeTiles(64, 64, 64, 4, 3),
    MoeTiles(128, 128, 64, 8, 3),
    MoeTiles(32, 64, 64, 4, 3),
    MoeTiles(64, 128, 64, 4, 4),
    MoeTiles(32, 128, 64, 4, 3),
    MoeTiles(64, 128, 64, 4, 3),
    MoeTiles(64, 128, 64, 8, 3),
    MoeTiles(64, 256, 64, 8, 3),
    MoeTiles(128, 64, 64, 4, 3),
    MoeTiles(128, 128, 64, 8, 4),
    MoeTiles(128, 128, 64, 4, 4),
    MoeTiles(64, 64, 128, 4, 3),
    MoeTiles(128, 128, 128, 8, 2),
    # 256-row blocks: at ~144 rows per expert (the 35B-A3B's 4,608-token step) one block per expert, so
    # each weight tile is loaded once for all of the expert's rows instead of once per 128-row block (the
    # kernels' time follows their blocks, not their padded rows: 2026-12-06-h100-gate-rope-moe-tails-slots32).
    # Compiled for sm_90 without register spills (gate_up at 254 registers); 128 columns spill there.
    # Measured on an H100: 1.12-1.28x the default's time at 4,608 tokens (2026-12-06-h100-gemv-preload).
    MoeTiles(256, 64, 64, 8, 3),
    MoeTiles(256, 64, 64, 8, 4),
    MoeTiles(256, 64, 32, 8, 4),
]
QUICK = SWEEP[:5]
# --split: (block_n, block_k, num_warps, num_stages) of one kernel, block_m the default's.
SPLIT = [
    (n, k, warps, stages) for n in (64, 128, 256) for k in (64, 128) for warps in (4, 8) for stages in (3, 4)
]
WARM_UP_SECONDS = 3.0


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected E,K,H,I (four positive integers), got {text!r}")
    experts, top_k, hidden, inter = (int(p) for p in parts)
    if top_k > experts:
        raise argparse.ArgumentTypeError(f"{top_k} experts per token exceed the {experts} experts")
    return experts, top_k, hidden, inter


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(p) for p in text.split(",")]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 16,2048, got {text!r}")
    return tokens


def make_inputs(tokens: int, shape: tuple[int, int, int, int], seed: int) -> tuple[torch.Tensor, ...]:
    """x, w13, w2 scaled so every stage stays O(1); routing from random logits (near uniform)."""
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device="cuda") * scale).to(DTYPE)

    x = randn(tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    weights, ids = reference.route(randn(tokens, experts), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def warm_up_clocks(inputs: tuple[torch.Tensor, ...], seconds: float = WARM_UP_SECONDS) -> None:
    """Runs the kernels for `seconds` before anything is timed: a GPU's clocks ramp up under load, and
    the first candidates of a cold sweep read up to 2x slow (seen on an H200)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            fused_experts(*inputs)
        torch.cuda.synchronize()


def label(tiles: MoeTiles, descriptors: bool) -> str:
    return f"{tuple(tiles)}{' tma' if descriptors else ''}"


def tflops(tokens: int, shape: tuple[int, int, int, int], ms: float) -> float:
    _, top_k, hidden, inter = shape
    return 2 * tokens * top_k * 3 * hidden * inter / ms / 1e9


def time_ms(inputs: tuple[torch.Tensor, ...], tiles: MoeTiles, down: MoeTiles) -> float:
    return triton.testing.do_bench(lambda: fused_experts(*inputs, tiles=tiles, down_tiles=down))


def sweep_split(tokens: int, inputs: tuple[torch.Tensor, ...], want: torch.Tensor, default: MoeTiles) -> None:
    """Each kernel's tiles with the other kernel's at the default; prints the best of each."""
    base = time_ms(inputs, default, default)
    print(f"\nT={tokens}: default {tuple(default)} {base:.4f} ms")
    for kernel in ("down", "gate_up"):
        results = []
        for n, k, warps, stages in SPLIT:
            tiles = MoeTiles(default.block_m, n, k, warps, stages)
            pair = (default, tiles) if kernel == "down" else (tiles, default)
            try:
                got = fused_experts(*inputs, tiles=pair[0], down_tiles=pair[1])
                ms = time_ms(inputs, *pair)
            except Exception as exc:  # out of shared memory, or a launch the GPU refuses
                print(f"  {kernel} {tuple(tiles)}: {type(exc).__name__}")
                continue
            same = (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()
            results.append((ms, tiles, same))
        results.sort(key=lambda r: r[0])
        for ms, tiles, same in results[:4]:
            mark = "" if same else " ! differs"
            print(f"  {kernel:8s} {str(tuple(tiles)):<26} {ms:.4f} ms  {base / ms:.3f}x the default{mark}")


def compare_grouped(cases: list, shape: tuple[int, int, int, int]) -> None:
    """Per token count: the Triton kernels and the grouped-GEMM path, eager and in a CUDA graph."""
    print(f"\n{'T':>6}{'triton ms':>11}{'grouped ms':>12}{'ratio':>7}{'graph: triton':>15}{'grouped':>9}")
    print(f"{'':>6}{'':>11}{'':>12}{'':>7}{'ms':>15}{'ms':>9}{'ratio':>7}{'TF/s':>6}{'max |diff|':>12}")
    for tokens, inputs, want, _ in cases:
        got = grouped_experts(*inputs)
        diff = (got.float() - want.float()).abs().max().item()
        eager = [
            triton.testing.do_bench(lambda f=f, inputs=inputs: f(*inputs))
            for f in (fused_experts, grouped_experts)
        ]
        graph = [
            triton.testing.do_bench_cudagraph(lambda f=f, inputs=inputs: f(*inputs))
            for f in (fused_experts, grouped_experts)
        ]
        print(
            f"{tokens:>6}{eager[0]:>11.4f}{eager[1]:>12.4f}{eager[0] / eager[1]:>6.2f}x"
            f"{graph[0]:>15.4f}{graph[1]:>9.4f}{graph[0] / graph[1]:>6.2f}x"
            f"{tflops(tokens, shape, graph[1]):>6.0f}{diff:>12.3g}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m deltaserve.bench.moe_kernel")
    parser.add_argument("--shape", type=parse_shape, default=SHAPE_35B_A3B, help="E,K,H,I")
    parser.add_argument("--tokens", type=parse_tokens, default=[16, 256, 2048, 8192])
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} candidates")
    parser.add_argument("--split", action="store_true", help="sweep each kernel's tiles on its own")
    parser.add_argument("--grouped", action="store_true", help="the Triton kernels against the grouped GEMM")
    parser.add_argument("--descriptors", action="store_true", help="each candidate with TMA descriptors too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    shape, candidates = args.shape, QUICK if args.quick else SWEEP
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"experts {shape[0]}, {shape[1]} per token, hidden {shape[2]}, expert {shape[3]}, {DTYPE}\n")
    cases = []
    for seed, tokens in enumerate(args.tokens):
        inputs = make_inputs(tokens, shape, seed)
        want = fused_experts(*inputs)
        error = (want.float() - reference.fused_experts(*inputs).float()).abs().max().item()
        default = default_tiles(tokens, shape[1], shape[0], DTYPE)
        print(f"T={tokens}: default {tuple(default)}, max |default - reference| = {error:.3g}")
        cases.append((tokens, inputs, want, default))
    warm_up_clocks(cases[-1][1])
    if args.grouped:
        compare_grouped(cases, shape)
        return
    if args.split:
        for tokens, inputs, want, default in cases:
            sweep_split(tokens, inputs, want, default)
        return
    print(
        f"\n{'tiles (m, n, k, warps, stages)':<36}"
        + "".join(f"{f'T={t} ms':>13}{'TF/s':>6}" for t in args.tokens)
    )
    best: dict[int, tuple[float, MoeTiles, bool]] = {}
    default_ms: dict[int, float] = {}
    for tiles, descriptors in (
        (t, d) for t in candidates for d in ((False, True) if args.descriptors else (False,))
    ):
        cells = []
        for tokens, inputs, want, default in cases:
            try:
                got = fused_experts(*inputs, tiles=tiles, descriptors=descriptors)
                ms = triton.testing.do_bench(
                    lambda inputs=inputs, tiles=tiles, d=descriptors: fused_experts(
                        *inputs, tiles=tiles, descriptors=d
                    )
                )
            except Exception as exc:  # out of shared memory, tiles that do not divide, a launch refused
                cells.append(f"{'n/a':>13}{'':>6}")
                print(f"  {label(tiles, descriptors)} at T={tokens}: {type(exc).__name__}: {exc}")
                continue
            same = (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()
            is_default = tiles == default and not descriptors
            mark = ("*" if is_default else "") + ("" if same else "!")
            cells.append(f"{ms:>12.4f}{mark:<1}{tflops(tokens, shape, ms):>6.0f}")
            if is_default:
                default_ms[tokens] = ms
            if same and (tokens not in best or ms < best[tokens][0]):
                best[tokens] = (ms, tiles, descriptors)
        print(f"{label(tiles, descriptors):<36}" + "".join(cells))
    print("\n* the default; ! differs from the default's output beyond bf16 rounding; tma: descriptors")
    for tokens, *_ in cases:
        if tokens in best:
            ms, tiles, descriptors = best[tokens]
            versus = f", {default_ms[tokens] / ms:.2f}x the default" if tokens in default_ms else ""
            print(
                f"T={tokens}: best {label(tiles, descriptors)}, {ms:.4f} ms "
                f"({tflops(tokens, shape, ms):.0f} TFLOP/s){versus}"
            )


if __name__ == "__main__":
    main()
