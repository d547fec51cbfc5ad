"""Gated full attention of Qwen3.5: q/k zero-centred RMSNorm, partial RoPE, paged GQA, sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.model.layers.parallel import SINGLE, TensorParallel
from deltaserve.model.layers.params import WeightRequirement, new_param, single, stacked
from deltaserve.ops import (
    NormedInput,
    normed_linear,
    paged_attention,
    qk_norm_rope_write_kv,
    sigmoid_gated_linear,
)
from deltaserve.ops.batch import ForwardBatch


class GatedAttention(nn.Module):
    """`cfg` is this rank's geometry (ModelConfig.shard); `forward` returns o_proj's partial sum under
    tensor parallelism (the caller all-reduces)."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        hidden = cfg.hidden_size
        # q_proj rows are per head [query_h (head_dim) | gate_h (head_dim)]; then k, then v.
        self.q_size = 2 * self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = new_param((self.q_size + 2 * self.kv_size, hidden), dtype, device)
        self.o_proj = new_param((hidden, self.num_heads * self.head_dim), dtype, device)
        self.q_norm = new_param((self.head_dim,), dtype, device)
        self.k_norm = new_param((self.head_dim,), dtype, device)

    def weight_requirements(self, prefix: str) -> list[WeightRequirement]:
        return [
            stacked(
                self.qkv_proj,
                [
                    (f"{prefix}.q_proj.weight", self.q_size),
                    (f"{prefix}.k_proj.weight", self.kv_size),
                    (f"{prefix}.v_proj.weight", self.kv_size),
                ],
                self.tp.shard(0),  # whole heads: each head's [query | gate] rows are contiguous
            ),
            single(f"{prefix}.o_proj.weight", self.o_proj, self.tp.shard(1)),
            single(f"{prefix}.q_norm.weight", self.q_norm),
            single(f"{prefix}.k_norm.weight", self.k_norm),
        ]

    @property
    def first_projection(self) -> torch.Tensor:
        """The weight a forward streams first (prefetched ahead of it at GEMV rows)."""
        return self.qkv_proj

    def forward(
        self,
        x: torch.Tensor | NormedInput,
        batch: ForwardBatch,
        inv_freq: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        then: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`then`: the weight the step streams after this layer's (prefetched at GEMV rows: ops.linear)."""
        qkv = normed_linear(x, self.qkv_proj, self.o_proj)
        tokens = qkv.shape[0]
        q_gate, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        k_cache, v_cache = kv
        q = qk_norm_rope_write_kv(
            q,
            k.view(tokens, self.num_kv_heads, self.head_dim),
            v.view(tokens, self.num_kv_heads, self.head_dim),
            self.q_norm,
            self.k_norm,
            self.eps,
            batch.positions,
            inv_freq,
            k_cache,
            v_cache,
            batch.slot_mapping,
        )
        out = paged_attention(q, k_cache, v_cache, batch, self.scale)
        return sigmoid_gated_linear(out.reshape(tokens, -1), gate, self.o_proj, then)
