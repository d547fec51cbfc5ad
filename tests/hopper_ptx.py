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
