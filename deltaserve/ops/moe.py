"""Top-k softmax routing and the routed experts of a Qwen3.5 MoE block (torch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.activation import silu_and_mul


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, top-k, optionally renormalised to sum 1; weights are cast back
    to the logits' dtype. Returns (weights [T, k], expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]. Sum over each token's experts
    of weight * down(silu(gate x) * up x)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token_idx, k_idx = torch.where(ids == expert)
        h = silu_and_mul(F.linear(x[token_idx], w13[expert]))
        h = F.linear(h, w2[expert]) * weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out
