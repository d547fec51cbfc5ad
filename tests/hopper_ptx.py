"""Kernels compiled for sm_90 without a GPU: Triton's own compiler and ptxas, outside the interpreter, in a
process of its own (the interpreter is decided at import, and this process's kernels run in it)."""

from __future__ import annotations

import os
import subprocess
import sys


def hopper_ptx(script: str, *args: str) -> list[str]:
    """The PTX instructions `script` prints (it compiles a kernel with `triton.compiler.compile` for
    `GPUTarget("cuda", 90, 32)` and prints `.asm["ptx"]`), without directives, comments and braces."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (line.strip() for line in done.stdout.splitlines())
    return [line for line in lines if line and not line.startswith((".", "//", ")")) and line not in "{}"]


_COMPILE_KERNEL = """
import importlib
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

module, kernel, signature, constexprs = sys.argv[1], sys.argv[2], eval(sys.argv[3]), eval(sys.argv[4])
signature |= {name: "constexpr" for name in constexprs}
fn = getattr(importlib.import_module(module), kernel)
source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
print(compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
"""


def kernel_ptx(
    module: str, kernel: str, signature: dict[str, str], constexprs: dict[str, object]
) -> list[str]:
    """The PTX instructions of `module.kernel` compiled for sm_90 with `signature` (argument name ->
    Triton type, e.g. "*bf16", "i32") and `constexprs` (name -> value)."""
    return hopper_ptx(_COMPILE_KERNEL, module, kernel, repr(signature), repr(constexprs))


def bf16_fmas(code: list[str]) -> list[str]:
    """The fused multiply-adds in 16-bit types: each one skips the rounding of a product that torch, with
    a separate multiply and add, keeps."""
    return [
        line
        for line in code
        if line.startswith("fma") and (".bf16" in line.split()[0] or ".f16" in line.split()[0])
    ]
