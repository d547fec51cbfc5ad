"""SwiGLU activation and gated attention's sigmoid output gate (torch references)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * I] with the gate first. Returns silu(gate) * up, [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x: [T, H * D] (an attention output); gate: [T, H, D]. Returns x * sigmoid(gate) as [T, H, D]:
    the sigmoid rounded to gate's dtype, then the product, as HF's gated attention computes it."""
    return x.reshape(gate.shape) * torch.sigmoid(gate)
