"""The decode linears at 1..4 rows on CUDA: the GEMV (the weight streamed once for all rows) against
cuBLAS (F.linear) and the skinny GEMM, at the Qwen3.5-4B shapes, bf16.

Each weight set is larger than the L2 (the weights cycle as in a decode step), times are medians of
triton.testing.do_bench; the bandwidth is the weight's bytes over the time. Every row count is checked
against F.linear first (one bf16 rounding apart).

python3 -m deltaserve.bench.linear_kernel   (needs CUDA; docs/benchmarks/2026-12-02-h200-gemv-rows.md)

With --fused: the GEMV fusions of one decode row (DELTASERVE_FUSED_GEMV: the SwiGLU activation, the
attention output gate and the GDN output norm into the following GEMV; a layer's input RMSNorm and
residual add into its first projection, gemv_rms_norm; the gate_up GEMV writing the SwiGLU activation,
gemv_swiglu_out; a GDN in_proj convolving its q | k | v as it writes them) against the kernels they
replace, inside CUDA graphs as a decode step runs them (the per-kernel gaps included), per layer call.

With --prefetch: each decode linear behind a GEMV and short kernels (1 or 4 RMSNorms of a hidden row,
standing in for a step's norms, convolution and recurrent update), the GEMV before it prefetching the
first N MiB of its weight into L2 as it ends (DELTASERVE_L2_PREFETCH_MIB) against no prefetch, inside CUDA
graphs.

With --preload: the same pairs, each linear loading its first weight block before the PDL wait
(DELTASERVE_GEMV_PRELOAD) or not, with and without the 4 MiB prefetch.

With --tma: one decode row's GEMV with the weight streamed through TMA (ops/triton/gemv_tma.py), autotuned
and at each of its launch shapes, against the pointer GEMV as a decode step launches it, inside CUDA
graphs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton.testing

from deltaserve.ops.batch import BatchRow, build_forward_batch
from deltaserve.ops.triton import linear
from deltaserve.ops.triton.activation import silu_and_mul
from deltaserve.ops.triton.conv1d import causal_conv1d
from deltaserve.ops.triton.linear import (
    GEMV_MAX_ROWS,
    DecodeConv,
    NextWeight,
    gemv,
    gemv_gated_norm,
    gemv_rms_norm,
    gemv_sigmoid_gated,
    gemv_swiglu,
    gemv_swiglu_out,
    skinny_gemm,
)
from deltaserve.ops.triton.norm import gated_rms_norm, rms_norm

if TYPE_CHECKING:
    from deltaserve.ops.triton.gemv_tma import TmaBlocks

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
# (name, N, K) of the 4B shape's decode linears (hidden 2560, intermediate 9216, vocab 248,320).
SHAPES = [
    ("gdn in_proj", 12352, 2560),
    ("gdn out_proj", 2560, 4096),
    ("attn qkv", 10240, 2560),
    ("mlp gate_up", 18432, 2560),
    ("mlp down", 2560, 9216),
    ("lm_head", 248320, 2560),
]
COPIES = 8  # weight copies cycled per timing: more than the L2 between two uses of one copy


def time_ms(fn, weights: list[torch.Tensor]) -> float:
    state = {"i": 0}

    def step() -> None:
        fn(weights[state["i"] % len(weights)])
        state["i"] += 1

    return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")


def graph_ms(fn, weights: list[torch.Tensor], reps: int = 200) -> float:
    """Median ms of one fn(w) call, replayed in a CUDA graph that calls it once per weight copy."""
    for w in weights:  # compiles and tunes outside the capture
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(weights))
    return sorted(times)[len(times) // 2]


def fused_main() -> None:
    """Each GEMV fusion at the 4B shape against the kernels it replaces."""
    hidden, inter, eps = 2560, 9216, 1e-6
    weights = {
        (n, k): [torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02 for _ in range(COPIES)]
        for n, k in ((hidden, inter), (hidden, 4096), (12352, hidden), (18432, hidden))
    }
    h, residual = (torch.randn(1, hidden, device=DEV, dtype=DTYPE) for _ in range(2))
    layer_norm_w = torch.randn(hidden, device=DEV, dtype=DTYPE) * 0.2
    conv_dim = 8192  # the 4B GDN layer's q | k | v channels, a window of 3 inputs each
    conv_w = torch.randn(conv_dim, 4, device=DEV, dtype=DTYPE) * 0.5
    conv_state = torch.randn(2, conv_dim, 3, device=DEV, dtype=DTYPE)
    row = build_forward_batch(
        [BatchRow([1], context_len=3, pages=[0], state_slot=1)], page_size=16, device=DEV
    )
    fused_state = conv_state.clone()  # each side shifts its own window, by the same inputs
    conv = DecodeConv(conv_w, fused_state, row.state_slots)
    gate_up = torch.randn(1, 2 * inter, device=DEV, dtype=DTYPE)
    q_gate = torch.randn(1, 16, 512, device=DEV, dtype=DTYPE)  # attention: 16 heads x [query | gate] of 256
    attn, gate = torch.randn(1, 4096, device=DEV, dtype=DTYPE), q_gate[..., 256:]
    o = torch.randn(1, 32, 128, device=DEV, dtype=DTYPE)  # GDN: 32 value heads of 128
    z = torch.randn(1, 2 * 4096, device=DEV, dtype=DTYPE)[:, 4096:].view(1, 32, 128)
    norm_w = torch.randn(128, device=DEV, dtype=DTYPE) * 0.2 + 1
    pairs = [
        (
            "mlp down + SwiGLU",
            (hidden, inter),
            lambda w: gemv(silu_and_mul(gate_up), w),
            lambda w: gemv_swiglu(gate_up, w),
        ),
        (
            "attn o_proj + gate",
            (hidden, 4096),
            lambda w: gemv(attn * torch.sigmoid(gate.reshape(1, -1)), w),
            lambda w: gemv_sigmoid_gated(attn, gate, w),
        ),
        (
            "gdn out_proj + norm",
            (hidden, 4096),
            lambda w: gemv(gated_rms_norm(o, z, norm_w, eps).reshape(1, -1), w),
            lambda w: gemv_gated_norm(o, z, norm_w, eps, w),
        ),
        (
            "gdn in_proj + rmsnorm",
            (12352, hidden),
            lambda w: gemv(rms_norm(h, layer_norm_w, eps, residual)[0], w),
            lambda w: gemv_rms_norm(h, layer_norm_w, eps, w, residual=residual)[0],
        ),
        (
            "mlp gate_up + rmsnorm",
            (18432, hidden),
            lambda w: gemv(rms_norm(h, layer_norm_w, eps, residual)[0], w),
            lambda w: gemv_rms_norm(h, layer_norm_w, eps, w, residual=residual)[0],
        ),
        (
            "gdn in_proj + conv",
            (12352, hidden),
            lambda w: causal_conv1d(gemv(h, w)[:, :conv_dim], conv_w, conv_state, row),
            lambda w: gemv(h, w, conv=conv)[:, :conv_dim],
        ),
        (
            "mlp gate_up + act out",
            (18432, hidden),
            lambda w: silu_and_mul(gemv(h, w)),
            lambda w: gemv_swiglu_out(h, w),
        ),
        (
            "gate_up + norm + act",
            (18432, hidden),
            lambda w: silu_and_mul(gemv(rms_norm(h, layer_norm_w, eps, residual)[0], w)),
            lambda w: gemv_rms_norm(h, layer_norm_w, eps, w, residual=residual, swiglu_out=True)[0],
        ),
    ]
    print(f"{'layer op':<22}{'unfused ms':>12}{'fused ms':>10}{'saved us':>10}  same bits")
    for name, shape, unfused, fused in pairs:
        ws = weights[shape]
        same = torch.equal(unfused(ws[0]), fused(ws[0]))
        torch.testing.assert_close(fused(ws[0]).float(), unfused(ws[0]).float(), rtol=2**-7, atol=2e-2)
        t_unfused, t_fused = graph_ms(unfused, ws), graph_ms(fused, ws)
        print(f"{name:<22}{t_unfused:>12.4f}{t_fused:>10.4f}{(t_unfused - t_fused) * 1e3:>10.1f}  {same}")


PREFETCH_MIB = (4, 8, 16, 32)


def _behind_short_kernels(variants: dict[str, dict]) -> None:
    """Each decode linear behind a GEMV (the 4B down projection) and `gap` RMSNorms, in CUDA graphs, as a
    decode step runs it: ms per pair with the baseline (the first variant), and the µs each other variant
    saves. A variant is keyword settings: `prefetch_mib` for the GEMV before, `preload` for
    linear.PRELOAD."""
    hidden = 2560
    h = torch.randn(1, hidden, device=DEV, dtype=DTYPE)
    norm_w = torch.randn(hidden, device=DEV, dtype=DTYPE) * 0.2
    x_before = torch.randn(1, 9216, device=DEV, dtype=DTYPE)
    before = [torch.randn(hidden, 9216, device=DEV, dtype=DTYPE) * 0.02 for _ in range(COPIES)]
    names = list(variants)
    print(
        f"{'linear':<14}{'gap':>4}{'gap ms':>9}{'pair ms':>9}"
        + "".join(f"{n:>12}" for n in names[1:])
        + "  (saved us)"
    )
    for name, n, k in SHAPES[:-1]:
        weights = [torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02 for _ in range(COPIES)]
        pairs = list(zip(before, weights, strict=True))
        x = torch.randn(1, k, device=DEV, dtype=DTYPE)
        for gap in (1, 4):

            def step(pair, prefetch_mib: int = 0, gap: int = gap, x=x) -> None:
                first, following = pair
                gemv(
                    x_before,
                    first,
                    prefetch=NextWeight(following, prefetch_mib << 20) if prefetch_mib else None,
                )
                for _ in range(gap):
                    rms_norm(h, norm_w, 1e-6)
                gemv(x, following)

            def timed(settings: dict, pairs: list = pairs) -> float:
                kept = linear.PRELOAD
                linear.PRELOAD = settings.get("preload", kept)
                try:
                    return graph_ms(lambda pair: step(pair, settings.get("prefetch_mib", 0)), pairs)
                finally:
                    linear.PRELOAD = kept

            t_gap = graph_ms(lambda pair, gap=gap: [rms_norm(h, norm_w, 1e-6) for _ in range(gap)], pairs)
            t_base = timed(variants[names[0]])
            saved = "".join(f"{(t_base - timed(variants[v])) * 1e3:>12.2f}" for v in names[1:])
            print(f"{name:<14}{gap:>4}{t_gap:>9.4f}{t_base:>9.4f}{saved}")


PREFETCH_MIB = (4, 8, 16, 32)


def prefetch_main() -> None:
    """The GEMV before each linear prefetching its weight's first MiB or not (the preload off)."""
    variants = {"none": {"preload": False}} | {
        f"{m} MiB": {"prefetch_mib": m, "preload": False} for m in PREFETCH_MIB
    }
    _behind_short_kernels(variants)


def preload_main() -> None:
    """Each linear loading its first weight block before the PDL wait or not, with and without the 4 MiB
    L2 prefetch of the GEMV before."""
    _behind_short_kernels(
        {
            "neither": {"preload": False},
            "preload": {"preload": True},
            "4 MiB": {"prefetch_mib": 4, "preload": False},
            "both": {"prefetch_mib": 4, "preload": True},
        }
    )


def tma_main(launch_shapes: Sequence[TmaBlocks] | None = None) -> None:
    """The TMA GEMV against the pointer GEMV at one row, each shape's weights cycling through more than L2:
    autotuned over its CONFIGS, and at each of `launch_shapes` (None: CONFIGS)."""
    from deltaserve.ops.triton.gemv_tma import CONFIGS, gemv_tma

    launch_shapes = CONFIGS if launch_shapes is None else launch_shapes
    torch.manual_seed(0)
    shapes = " ".join(f"{c.block_n}x{c.block_k}/{c.warps}w/{c.stages}s" for c in launch_shapes)
    print(f"TMA launch shapes (rows x K / warps / stages): {shapes}")
    print(f"{'linear':<14}{'gemv TB/s':>11}{'tma TB/s':>10}{'tma/gemv':>10}  tma TB/s at each launch shape")
    for name, n, k in SHAPES:
        copies = 2 if n * k * 2 > 256 * 2**20 else COPIES
        weights = [torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=DEV, dtype=DTYPE)
        want = F.linear(x.float(), weights[0].float())
        torch.testing.assert_close(gemv_tma(x, weights[0]).float(), want, rtol=2**-7, atol=2e-2)
        weight_bytes = n * k * 2

        def tbs(ms: float, weight_bytes: int = weight_bytes) -> float:
            return weight_bytes / (ms * 1e-3) / 1e12

        t_gemv = graph_ms(lambda w, x=x: gemv(x, w), weights)
        t_tma = graph_ms(lambda w, x=x: gemv_tma(x, w), weights)
        each = [tbs(graph_ms(lambda w, x=x, c=c: gemv_tma(x, w, blocks=c), weights)) for c in launch_shapes]
        print(
            f"{name:<14}{tbs(t_gemv):>11.2f}{tbs(t_tma):>10.2f}{t_gemv / t_tma:>9.2f}x  "
            + " ".join(f"{v:.2f}" for v in each)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(str(m) for m in range(1, GEMV_MAX_ROWS + 1)))
    parser.add_argument(
        "--fused", action="store_true", help="the GEMV fusions against the kernels they replace"
    )
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="each linear behind short kernels, its weight prefetched or not",
    )
    parser.add_argument(
        "--preload",
        action="store_true",
        help="each linear behind short kernels, its first weight block loaded before the PDL wait or not",
    )
    parser.add_argument(
        "--tma",
        action="store_true",
        help="the GEMV streaming its weight through TMA against the pointer GEMV",
    )
    args = parser.parse_args()
    if args.tma:
        tma_main()
        return
    if args.preload:
        preload_main()
        return
    if args.fused:
        fused_main()
        return
    if args.prefetch:
        prefetch_main()
        return
    rows_list = [int(m) for m in args.rows.split(",")]
    torch.manual_seed(0)
    print(
        f"{'linear':<14}{'rows':>5}{'gemv ms':>10}{'cuBLAS ms':>11}{'skinny ms':>11}{'gemv TB/s':>11}{'vs cuBLAS':>11}"
    )
    for name, n, k in SHAPES:
        copies = 2 if n * k * 2 > 256 * 2**20 else COPIES
        weights = [torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, device=DEV, dtype=DTYPE)
            want = F.linear(x.float(), weights[0].float())
            torch.testing.assert_close(gemv(x, weights[0]).float(), want, rtol=2**-7, atol=2e-2)
            t_gemv = time_ms(lambda w, x=x: gemv(x, w), weights)
            t_blas = time_ms(lambda w, x=x: F.linear(x, w), weights)
            t_skinny = time_ms(lambda w, x=x: skinny_gemm(x, w), weights)
            tbs = n * k * 2 / (t_gemv * 1e-3) / 1e12
            print(
                f"{name:<14}{m:>5}{t_gemv:>10.4f}{t_blas:>11.4f}{t_skinny:>11.4f}{tbs:>11.2f}{t_blas / t_gemv:>10.2f}x"
            )


if __name__ == "__main__":
    main()
