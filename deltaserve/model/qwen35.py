"""Qwen3.5 text model (dense and MoE) over one flattened varlen batch.

Layer i is Gated DeltaNet or gated full attention per `layer_types`; every layer is
x += mixer(norm(x)); x += mlp(norm(x)), with the residual add fused into the next norm.
Full-attention layers read/write the paged KV pool; GDN layers read/write the state slot pool.
Logits are computed only for `batch.logits_indices` and only over the first `logits_vocab_size` ids
(the tokenizer's id space; the checkpoint's vocab is padded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import FULL_ATTENTION, ModelConfig
from deltaserve.model.layers.decoder import DecoderLayer
from deltaserve.model.layers.parallel import SINGLE, TensorParallel
from deltaserve.model.layers.params import WeightRequirement, new_param, single
from deltaserve.ops import linear, rms_norm
from deltaserve.ops.batch import CacheLayers, ForwardBatch
from deltaserve.ops.rotary import inv_frequencies


class Qwen35ForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        logits_vocab_size: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """`cfg` is the checkpoint's config; under tensor parallelism (`tp`) the layers hold this rank's
        shard (deltaserve.model.layers.parallel) and the caches follow `self.local_config`."""
        super().__init__()
        if logits_vocab_size is not None and not 0 < logits_vocab_size <= cfg.vocab_size:
            raise ValueError(
                f"the tokenizer's id space ({logits_vocab_size}) must fit the model vocabulary ({cfg.vocab_size})"
            )
        self.config = cfg
        self.local_config = cfg.shard(tp.size)
        self.tp = tp
        self.dtype = dtype
        self.device = device
        self.logits_vocab_size = logits_vocab_size or cfg.vocab_size
        self.embed_tokens = new_param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(self.local_config, t, dtype, device, tp) for t in cfg.layer_types
        )
        self.norm = new_param((cfg.hidden_size,), dtype, device)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else new_param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        )
        self.register_buffer(
            "inv_freq", inv_frequencies(cfg.rotary_dim, cfg.rope_theta, device), persistent=False
        )
        # Index of each layer within its kind: the KV pool holds full-attention layers only, the state
        # pool GDN layers only.
        self.cache_index = [
            cfg.full_attention_layers.index(i)
            if t == FULL_ATTENTION
            else cfg.linear_attention_layers.index(i)
            for i, t in enumerate(cfg.layer_types)
        ]

    def weight_requirements(self) -> list[WeightRequirement]:
        reqs = [single("embed_tokens.weight", self.embed_tokens), single("norm.weight", self.norm)]
        if not self.config.tie_word_embeddings:
            reqs.append(single("lm_head.weight", self.lm_head))
        for i, layer in enumerate(self.layers):
            reqs += layer.weight_requirements(f"layers.{i}")
        return reqs

    def forward(self, batch: ForwardBatch, kv: CacheLayers, states: CacheLayers) -> torch.Tensor:
        """Runs every new token of the batch; returns the final-normed hidden states of the
        `batch.logits_indices` rows, [R, hidden]."""
        h = F.embedding(batch.input_ids, self.embed_tokens)
        residual: torch.Tensor | None = None
        for layer, cache_index in zip(self.layers, self.cache_index, strict=True):
            if residual is None:
                residual = h
                x = rms_norm(h, layer.input_layernorm, layer.eps)
            else:
                x, residual = rms_norm(h, layer.input_layernorm, layer.eps, residual)
            if layer.is_full_attention:
                h = layer.mixer(x, batch, self.inv_freq, kv.layer(cache_index))
            else:
                h = layer.mixer(x, batch, states.layer(cache_index))
            x, residual = rms_norm(
                self.tp.all_reduce_(h), layer.post_attention_layernorm, layer.eps, residual
            )
            h = self.tp.all_reduce_(layer.mlp(x))
        rows = batch.logits_indices
        return rms_norm(h[rows], self.norm, self.config.rms_norm_eps, residual[rows])[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, logits_vocab_size] float32. The GEMM runs over a width rounded up to a
        multiple of 64 rows of the (padded) vocabulary: an odd width like 248077 sends cuBLAS to slow,
        unaligned kernels."""
        n = self.logits_vocab_size
        width = min(self.config.vocab_size, -(-n // 64) * 64)
        return linear(hidden, self.lm_head[:width])[:, :n].float()
