"""Test-wide set-up. Without CUDA, Triton kernels run in Triton's CPU interpreter, so kernel logic is
tested in CI too; this must happen before any kernel module is imported (decoration time)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
