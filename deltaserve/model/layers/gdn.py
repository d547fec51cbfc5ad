"""Gated DeltaNet (linear attention) layer of Qwen3.5.

in_proj (fused: qkv | z | b | a) -> causal conv1d + SiLU over qkv -> gating in fp32 -> gated delta rule
over the sequence's SSM state -> per-head gated RMSNorm with z -> out_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.model.layers.parallel import SINGLE, TensorParallel
from deltaserve.model.layers.params import WeightRequirement, new_param, single, stacked
from deltaserve.ops import (
    NormedInput,
    gated_delta_rule,
    gated_norm_linear,
    in_proj_conv,
)
from deltaserve.ops.batch import ForwardBatch


class GatedDeltaNet(nn.Module):
    """`cfg` is this rank's geometry (ModelConfig.shard: its key and value heads); `forward` returns
    out_proj's partial sum under tensor parallelism (the caller all-reduces)."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = cfg.linear_key_dim
        self.value_dim = cfg.linear_value_dim
        self.conv_dim = cfg.conv_dim
        self.eps = cfg.rms_norm_eps
        hidden = cfg.hidden_size
        self.in_proj = new_param(
            (self.conv_dim + self.value_dim + 2 * self.num_v_heads, hidden), dtype, device
        )
        self.conv1d = new_param((self.conv_dim, cfg.linear_conv_kernel_dim), dtype, device)
        # Decay parameters stay fp32 whatever the model dtype (A_log in bf16 loses the decay's precision).
        self.A_log = new_param((self.num_v_heads,), torch.float32, device)
        self.dt_bias = new_param((self.num_v_heads,), torch.float32, device)
        self.norm = new_param((self.head_v_dim,), dtype, device)
        self.out_proj = new_param((hidden, self.value_dim), dtype, device)

    def weight_requirements(self, prefix: str) -> list[WeightRequirement]:
        tp = self.tp
        # The q | k | v channels (of in_proj_qkv's rows and of the conv) shard each by heads.
        channels = tp.shard(0, tuple(tp.size * d for d in (self.key_dim, self.key_dim, self.value_dim)))
        return [
            single(f"{prefix}.in_proj_qkv.weight", self.in_proj[: self.conv_dim], channels),
            stacked(
                self.in_proj[self.conv_dim :],
                [
                    (f"{prefix}.in_proj_z.weight", self.value_dim),
                    (f"{prefix}.in_proj_b.weight", self.num_v_heads),
                    (f"{prefix}.in_proj_a.weight", self.num_v_heads),
                ],
                tp.shard(0),
            ),
            single(f"{prefix}.conv1d.weight", self.conv1d.view(self.conv_dim, 1, -1), channels),
            single(f"{prefix}.A_log", self.A_log, tp.shard(0)),
            single(f"{prefix}.dt_bias", self.dt_bias, tp.shard(0)),
            single(f"{prefix}.norm.weight", self.norm),
            single(f"{prefix}.out_proj.weight", self.out_proj, tp.shard(1)),
        ]

    @property
    def first_projection(self) -> torch.Tensor:
        """The weight a forward streams first (prefetched ahead of it at GEMV rows)."""
        return self.in_proj

    def forward(
        self,
        x: torch.Tensor | NormedInput,
        batch: ForwardBatch,
        state: tuple[torch.Tensor, torch.Tensor],
        then: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`then`: the weight the step streams after this layer's (prefetched at GEMV rows: ops.linear)."""
        conv_state, ssm_state = state
        proj, q, k, v = in_proj_conv(
            x, self.in_proj, self.conv1d, conv_state, batch, self.key_dim, 2 * self.key_dim, self.out_proj
        )
        tokens = proj.shape[0]
        _, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        out = gated_delta_rule(
            q.view(tokens, self.num_k_heads, self.head_k_dim),
            k.view(tokens, self.num_k_heads, self.head_k_dim),
            v.view(tokens, self.num_v_heads, self.head_v_dim),
            a,
            b,
            self.A_log,
            self.dt_bias,
            ssm_state,
            batch,
        )
        z = z.reshape(tokens, self.num_v_heads, self.head_v_dim)
        return gated_norm_linear(out, z, self.norm, self.eps, self.out_proj, then)
