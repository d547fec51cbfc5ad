"""Kernels compiled for sm_90 without a GPU: Triton's own compiler and ptxas, outside the interpreter, in a
process of its own (the interpreter is decided at import, and this process's kernels run in it)."""

from __future__ import annotations

import os
import subprocess
import sys


def compiled_output(script: str, *args: str, timeout: int = 120) -> str:
    """What `script` prints, run with `args` in a process of its own where Triton compiles instead of
    interpreting (TRITON_INTERPRET unset); fails the test with its stderr when it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def hopper_ptx(script: str, *args: str) -> list[str]:
    """The PTX instructions `script` prints (it compiles a kernel with `triton.compiler.compile` for
    `GPUTarget("cuda", 90, 32)` and prints `.asm["ptx"]`), without directives, comments and braces."""
    lines = (line.strip() for line in compiled_output(script, *args).splitlines())
    return [line for line in lines if line and not line.startswith((".", "//", ")")) and line not in "{}"]


# A script for hopper_ptx: argv[1] "prefetch" (the L2 prefetch kernel of its own) or "gemv" (the GEMV at
# ROWS 1, BLOCK_N 8, BLOCK_K 256, 4 warps, with the L2 prefetch; argv[2]: PRELOAD, 1 by default; argv[3]:
# SWIGLU_OUT, 0 by default; argv[4]: a comma list of integer arguments fixed at 1, as Triton specializes an
# integer argument that is 1 at a launch; argv[5]: CONV_KW, 0 by default).
COMPILE_FOR_HOPPER = """
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from deltaserve.bench.gemv_registers import decode_row_constexprs, gemv_source
from deltaserve.ops.triton import prefetch

if sys.argv[1] == "prefetch":
    constexprs = {"USE_GDC": True}
    signature = {"base": "i64", "nbytes": "i32"} | {name: "constexpr" for name in constexprs}
    source = ASTSource(fn=prefetch._l2_prefetch_kernel, signature=signature, constexprs=constexprs)
else:
    constexprs = decode_row_constexprs(mode=0, k_pow2=1, block_n=8, block_k=256)
    constexprs["SWIGLU_OUT"] = len(sys.argv) > 3 and sys.argv[3] == "1"
    constexprs["CONV_KW"] = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    constexprs["PRELOAD"] = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for name in filter(None, (sys.argv[4] if len(sys.argv) > 4 else "").split(",")):
        constexprs[name] = 1
    source = gemv_source(constexprs)
print(compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
"""
