"""Paged causal attention with GQA (torch reference).

KV cache layout per full-attention layer: [num_pages, page_size, num_kv_heads, head_dim]. A token at
position p of a sequence lives at page block_table[p // page_size], offset p % page_size. A chunk of
new tokens attends to its sequence's cached context plus its own tokens, causally.
"""

from __future__ import annotations

import torch

from deltaserve.ops.batch import ForwardBatch


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' keys/values ([T, kv_heads, head_dim]) at their flat KV positions."""
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence's keys or values, [length, kv_heads, head_dim],
    gathered from its pages (`block_table`: its row of the batch's block tables)."""
    page_size, num_kv_heads, head_dim = cache.shape[1:]
    pages = block_table[: (length + page_size - 1) // page_size].long()
    return cache[pages].reshape(-1, num_kv_heads, head_dim)[:length]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q: [T, heads, head_dim] for the batch's new tokens, whose K/V are already written. Returns
    [T, heads, head_dim] in q's dtype; softmax in fp32."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, (n, ctx) in enumerate(zip(batch.query_lens_host, batch.context_lens_host, strict=True)):
        total = ctx + n
        keys = sequence_kv(k_cache, batch.block_tables[i], total).float()
        values = sequence_kv(v_cache, batch.block_tables[i], total).float()
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        qi = q[start : start + n].float()
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale
        query_pos = torch.arange(ctx, total, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        scores.masked_fill_(key_pos > query_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        start += n
    return out
