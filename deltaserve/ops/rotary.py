"""Partial NeoX rotary embedding (torch reference).

Only the first `rotary_dim` dims of each head rotate (pairs (i, i + rotary_dim/2)); the rest pass
through. Qwen3.5's interleaved M-RoPE with text-only positions (t = h = w) is exactly this 1-D RoPE.
cos/sin are computed in fp32 from the positions and cast to the activation dtype before use, as HF does.
"""

from __future__ import annotations

import torch


def inv_frequencies(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    if device.type == "meta":  # a shape only: arithmetic on meta tensors imports torch's compiler (~1.5 s)
        return torch.empty(rotary_dim // 2, dtype=torch.float, device=device)
    exponent = (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / rotary_dim
    )
    return 1.0 / (theta**exponent)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [T, rotary_dim] (the half-table repeated), in `dtype`."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, rotary_dim]. Returns a new tensor."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)
