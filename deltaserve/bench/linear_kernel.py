"""The decode linears at 1..4 rows on CUDA: the GEMV (the weight streamed once for all rows) against
cuBLAS (F.linear) and the skinny GEMM, at the Qwen3.5-4B shapes, bf16.

Each weight set is larger than the L2 (the weights cycle as in a decode step), times are medians of
triton.testing.do_bench; the bandwidth is the weight's bytes over the time. Every row count is checked
against F.linear first (one bf16 rounding apart).

python3 -m deltaserve.bench.linear_kernel   (needs CUDA; docs/benchmarks/2026-12-02-h200-gemv-rows.md)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from deltaserve.ops.triton.linear import GEMV_MAX_ROWS, gemv, skinny_gemm

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(str(m) for m in range(1, GEMV_MAX_ROWS + 1)))
    args = parser.parse_args()
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
