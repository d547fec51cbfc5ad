"""Registers and spills of the decode GEMV (ops/triton/linear.py) compiled ahead of time for sm_90, without
a GPU: Triton's compiler, then the ptxas Triton uses for that target, with -v. For each tuned block shape
(linear._CONFIGS), the plain GEMV and the "rmsnorm" fusion (the input norm and the residual add) at whole
rows padded to 2,048, 4,096 and 8,192 values. Run it with Triton compiling, not interpreting
(TRITON_INTERPRET unset); counts are those of the installed Triton.

python3 -m deltaserve.bench.gemv_registers   (docs/benchmarks/2026-12-06-h100-fusions-default.md)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

SM90 = 90
ROW_WIDTHS = (2048, 4096, 8192)  # K_POW2: the fused GEMV's whole row, padded to a power of two


@dataclass(frozen=True)
class Registers:
    """One compiled GEMV variant's register count and spill traffic (bytes stored to local memory)."""

    per_thread: int
    spill_bytes: int


def gemv_source(constexprs: dict[str, int | bool]):
    """The GEMV kernel as Triton's ahead-of-time source: bf16 tensors, int32 sizes and strides, the given
    constexprs (every other constexpr of the kernel must be among them)."""
    from triton.compiler import ASTSource

    from deltaserve.ops.triton import linear

    signature = {name: "*bf16" for name in ("x_ptr", "w_ptr", "out_ptr", "g_ptr", "nw_ptr", "res_out_ptr")}
    signature |= {"conv_w_ptr": "*bf16", "conv_state_ptr": "*bf16", "conv_slots_ptr": "*i32"}
    signature |= {"eps": "fp32", "N": "i32", "K": "i32"}
    signature |= {name: "i32" for name in ("stride_xm", "stride_wn", "stride_om", "stride_gm", "stride_gh")}
    signature |= {name: "i32" for name in ("conv_channels", "stride_cw_ch", "stride_cw_k")}
    signature |= {name: "i32" for name in ("stride_cs_slot", "stride_cs_ch", "stride_cs_k")}
    signature |= {"pf_base": "i64", "pf_bytes": "i32"}
    for name in constexprs:
        signature.pop(name, None)  # an argument fixed at a value (Triton specialises an integer 1 so)
    signature |= {name: "constexpr" for name in constexprs}
    return ASTSource(fn=linear._gemv_kernel, signature=signature, constexprs=constexprs)


def decode_row_constexprs(mode: int, k_pow2: int, block_n: int, block_k: int) -> dict[str, int | bool]:
    """The constexprs of one decode row's GEMV as a decode step launches it (the L2 prefetch, the weight
    preload and PDL on)."""
    return {
        "ROWS": 1,
        "MODE": mode,
        "HEAD_DIM": 1,
        "K_POW2": k_pow2,
        "SWIGLU_OUT": False,
        "CONV_KW": 0,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "PREFETCH": True,
        "PRELOAD": 1,
        "USE_GDC": True,
    }


def registers(mode: int, k_pow2: int, block_n: int, block_k: int, warps: int) -> Registers:
    """The GEMV variant compiled for sm_90: ptxas -v's register count and spill stores."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import compile

    source = gemv_source(decode_row_constexprs(mode, k_pow2, block_n, block_k))
    kernel = compile(source, target=GPUTarget("cuda", SM90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "gemv.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        done = subprocess.run(
            [get_ptxas(SM90).path, f"-arch=sm_{SM90}a", "-v", ptx, "-o", os.path.join(folder, "gemv.o")],
            capture_output=True,
            text=True,
            check=True,
        )
    used = re.search(r"Used (\d+) registers", done.stderr)
    spilled = re.search(r"(\d+) bytes spill stores", done.stderr)
    if used is None or spilled is None:
        raise RuntimeError(f"ptxas -v printed no register count or spill line: {done.stderr[-500:]!r}")
    return Registers(int(used.group(1)), int(spilled.group(1)))


def _cell(r: Registers) -> str:
    return f"{r.per_thread}" + (f", {r.spill_bytes} B spilled" if r.spill_bytes else "")


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    from deltaserve.ops.triton import linear

    widths = " | ".join(f"rmsnorm, row <= {k:,}" for k in ROW_WIDTHS)
    print(f"| block shape (N, K, warps) | plain | {widths} |")
    print("|---|---|" + "---|" * len(ROW_WIDTHS))
    for block_n, block_k, warps in linear._CONFIGS:
        plain = registers(linear.PLAIN, 1, block_n, block_k, warps)
        fused = [registers(linear.ADD_RMS_NORM, k, block_n, block_k, warps) for k in ROW_WIDTHS]
        print(f"| {block_n}, {block_k}, {warps} | {_cell(plain)} | " + " | ".join(map(_cell, fused)) + " |")


if __name__ == "__main__":
    main()
