"""The checkpoint's multi-token-prediction (MTP) head: drafts the token after next from the target's hidden.

For a token at position i (vLLM's Qwen3_5MultiTokenPredictor):
  x = fc(concat[pre_fc_norm_embedding(embed(token_{i+1})), pre_fc_norm_hidden(h_i)])
  x = one full-attention decoder layer over x (its own KV cache, rope position i)
  out = norm(x)
where h_i is the target model's final-normed hidden state at i; the draft logits are the target's lm_head
over `out`. Every norm is zero-centred (1 + w). The embedding and the lm_head are the target's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import FULL_ATTENTION, ModelConfig
from deltaserve.errors import ConfigError
from deltaserve.model.layers.decoder import DecoderLayer
from deltaserve.model.layers.parallel import SINGLE
from deltaserve.model.layers.params import WeightRequirement, new_param, single
from deltaserve.ops import linear, rms_norm
from deltaserve.ops.batch import ForwardBatch

SUPPORTED_MTP_LAYERS = 1


class MtpHead(nn.Module):
    """`mtp.*` of a checkpoint with mtp_num_hidden_layers == 1 (every official Qwen3.5 checkpoint); one
    rank only (tensor parallelism is refused by the model)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if cfg.mtp_num_hidden_layers != SUPPORTED_MTP_LAYERS:
            raise ConfigError(
                f"config.json text_config: mtp_num_hidden_layers must be {SUPPORTED_MTP_LAYERS} (the MTP "
                f"head deltaserve runs has one decoder layer), got {cfg.mtp_num_hidden_layers}"
            )
        hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.fc = new_param((hidden, 2 * hidden), dtype, device)  # input columns: [embedding | hidden]
        self.pre_fc_norm_embedding = new_param((hidden,), dtype, device)
        self.pre_fc_norm_hidden = new_param((hidden,), dtype, device)
        self.layer = DecoderLayer(cfg, FULL_ATTENTION, dtype, device, SINGLE)
        self.norm = new_param((hidden,), dtype, device)

    def weight_requirements(self, prefix: str = "mtp") -> list[WeightRequirement]:
        return [
            single(f"{prefix}.fc.weight", self.fc),
            single(f"{prefix}.pre_fc_norm_embedding.weight", self.pre_fc_norm_embedding),
            single(f"{prefix}.pre_fc_norm_hidden.weight", self.pre_fc_norm_hidden),
            *self.layer.weight_requirements(f"{prefix}.layers.0"),
            single(f"{prefix}.norm.weight", self.norm),
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        embed_tokens: torch.Tensor,
        batch: ForwardBatch,
        inv_freq: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """[T] next-token ids and the target's [T, hidden] final-normed hidden -> [T, hidden] MTP hidden;
        writes this layer's K and V at `batch.slot_mapping`."""
        emb = rms_norm(F.embedding(input_ids, embed_tokens), self.pre_fc_norm_embedding, self.eps)
        x = linear(torch.cat([emb, rms_norm(hidden, self.pre_fc_norm_hidden, self.eps)], dim=-1), self.fc)
        layer = self.layer
        h = layer.mixer(rms_norm(x, layer.input_layernorm, layer.eps), batch, inv_freq, kv)
        x, residual = rms_norm(h, layer.post_attention_layernorm, layer.eps, x)
        return rms_norm(layer.mlp(x), self.norm, self.eps, residual)[0]
