"""One Qwen3.5 decoder layer's parameters: its two norms, its mixer (gated full attention or Gated
DeltaNet) and its MLP (dense or sparse MoE). The model runs the layers itself, fusing each residual add
into the next norm."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import FULL_ATTENTION, ModelConfig
from deltaserve.model.layers.attention import GatedAttention
from deltaserve.model.layers.gdn import GatedDeltaNet
from deltaserve.model.layers.mlp import MLP, SparseMoeBlock
from deltaserve.model.layers.parallel import TensorParallel
from deltaserve.model.layers.params import WeightRequirement, new_param, single


class DecoderLayer(nn.Module):
    """`cfg` is this rank's geometry (ModelConfig.shard under tensor parallelism)."""

    def __init__(
        self, cfg: ModelConfig, layer_type: str, dtype: torch.dtype, device: torch.device, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.is_full_attention = layer_type == FULL_ATTENTION
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = new_param((cfg.hidden_size,), dtype, device)
        self.post_attention_layernorm = new_param((cfg.hidden_size,), dtype, device)
        self.mixer: GatedAttention | GatedDeltaNet = (
            GatedAttention(cfg, dtype, device, tp)
            if self.is_full_attention
            else GatedDeltaNet(cfg, dtype, device, tp)
        )
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(cfg, dtype, device, tp)
            if cfg.is_moe
            else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, tp)
        )

    def weight_requirements(self, prefix: str) -> list[WeightRequirement]:
        mixer = "self_attn" if self.is_full_attention else "linear_attn"
        return [
            single(f"{prefix}.input_layernorm.weight", self.input_layernorm),
            single(f"{prefix}.post_attention_layernorm.weight", self.post_attention_layernorm),
            *self.mixer.weight_requirements(f"{prefix}.{mixer}"),
            *self.mlp.weight_requirements(f"{prefix}.mlp"),
        ]
