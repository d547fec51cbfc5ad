"""RMSNorms of Qwen3.5 (torch reference).

Zero-centred RMSNorm (every norm but the GDN output norm): y = x * rsqrt(mean(x^2) + eps) * (1 + w),
computed in fp32 and rounded once at the end (Gemma-style, not Llama's cast-then-multiply).
Gated RMSNorm (GDN output, per head): y = w * norm(x).to(dtype) * silu(z), plain weight, norm before gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm over the last dim. With `residual`, first x = x + residual (in x's dtype)
    and returns (normed, new residual)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    y = y.to(x.dtype)
    return y if residual is None else (y, x)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-weight RMSNorm over the last dim of x, then times silu(z) in fp32; result in x's dtype."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * normed
    return (y.float() * F.silu(z.float())).to(x.dtype)
