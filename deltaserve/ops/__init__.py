"""The op boundary. Layers call these; each picks the GPU kernel for CUDA tensors and the torch
reference (the oracle, in the sibling modules) otherwise. DELTASERVE_REFERENCE_OPS=1 forces the
reference everywhere (to bisect a GPU discrepancy)."""

from __future__ import annotations

import os

import torch

from deltaserve.model.batch import ForwardBatch
from deltaserve.ops import gdn as _gdn_ref

REFERENCE_ONLY = os.environ.get("DELTASERVE_REFERENCE_OPS", "") == "1"


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and not REFERENCE_ONLY


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    if use_kernels(q):
        from deltaserve.ops.triton.gdn import gated_delta_rule as kernel

        return kernel(q, k, v, a, b, A_log, dt_bias, ssm_state, batch)
    return _gdn_ref.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, batch)
