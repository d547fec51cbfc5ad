"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still running. Its
first statement, `gdc_enter`, waits (griddepcontrol.wait) until that kernel has finished and its writes are
visible, then lets the next PDL kernel be scheduled (griddepcontrol.launch_dependents). So the launch
latency between two graph nodes overlaps the earlier kernel's tail instead of following it.

Invariant: nothing in a kernel before `gdc_enter` writes memory or reads memory that a kernel of a step
may write; the wait makes the kernel's memory order the same as a plain launch's, so its results are bit
for bit those of a plain launch. The one read before it: a GEMV's first block of its weight (read-only
while steps run; ops/triton/linear.py).
The wait is transitive: the earlier kernel itself ran past its own wait only after the one before it
finished.

On by default where the GPU supports it (compute capability 9.0 or later); `DELTASERVE_PDL=0` turns it
off. Measured on an H200 at the 4B shape, batch 1, over HTTP: TPOT 3.02 ms against 3.07 ms without it, in
runs on, off, on (docs/benchmarks/2026-12-04-h200-pdl-power-cudnn.md). CUDA graphs keep the programmatic
edges when a step is captured.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.device_info import hopper_or_later

ENABLED = os.environ.get("DELTASERVE_PDL", "1") != "0"


def use_pdl(device: torch.device) -> bool:
    """Whether a kernel launched on `device` now goes out with PDL (pass it as both USE_GDC and
    launch_pdl, see `launch_options`)."""
    return ENABLED and hopper_or_later(device)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a kernel with a USE_GDC parameter: the kernel's wait and the launch flag
    always agree, and no launch option is passed when PDL is off (the interpreter knows none)."""
    if use_pdl(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """The first statement of a kernel with a USE_GDC parameter (see the module docstring)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
