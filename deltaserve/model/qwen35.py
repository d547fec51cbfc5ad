"""Qwen3.5 text model (dense and MoE) over one flattened varlen batch.

Layer i is Gated DeltaNet or gated full attention per `layer_types`; every layer is
x += mixer(norm(x)); x += mlp(norm(x)), with the residual add fused into the next norm.
Full-attention layers read/write the paged KV pool; GDN layers read/write the state slot pool.
Logits are computed only for `batch.logits_indices` and only over the first `logits_vocab_size` ids
(the tokenizer's id space; the checkpoint's vocab is padded). With `mtp`, the checkpoint's MTP head
(deltaserve.model.mtp) is built too; its attention layer is the last layer of the KV pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import FULL_ATTENTION, ModelConfig
from deltaserve.errors import ConfigError
from deltaserve.model.layers.decoder import DecoderLayer
from deltaserve.model.layers.parallel import SINGLE, TensorParallel
from deltaserve.model.layers.params import WeightRequirement, new_param, single
from deltaserve.model.mtp import MtpHead
from deltaserve.ops import NormedInput, linear, prefetch_weight, rms_norm
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
        mtp: bool = False,
        draft_vocab_size: int | None = None,
    ) -> None:
        """`cfg` is the checkpoint's config; under tensor parallelism (`tp`) the layers hold this rank's
        shard (deltaserve.model.layers.parallel) and the caches follow `self.local_config`. `mtp` builds
        the checkpoint's MTP head (speculative decoding; one rank only); its proposals come from the
        first `draft_vocab_size` ids (all the logits' ids by default: `draft_tokens`)."""
        super().__init__()
        if logits_vocab_size is not None and not 0 < logits_vocab_size <= cfg.vocab_size:
            raise ValueError(
                f"the tokenizer's id space ({logits_vocab_size}) must fit the model vocabulary ({cfg.vocab_size})"
            )
        if mtp and cfg.mtp_num_hidden_layers == 0:
            raise ConfigError(
                "the checkpoint has no MTP head (mtp_num_hidden_layers is 0); speculative decoding with "
                "method 'mtp' needs one"
            )
        if mtp and tp.size > 1:
            raise ConfigError(
                f"the MTP head runs on one rank only, got --tensor-parallel-size {tp.size}; serve speculative "
                "decoding with --tensor-parallel-size 1"
            )
        self.config = cfg
        self.local_config = cfg.shard(tp.size)
        self.tp = tp
        self.dtype = dtype
        self.device = device
        self.logits_vocab_size = logits_vocab_size or cfg.vocab_size
        if draft_vocab_size is not None and not 0 < draft_vocab_size <= self.logits_vocab_size:
            raise ConfigError(
                f"--speculative-config: 'draft_vocab_size' must be in 1..{self.logits_vocab_size} (the "
                f"tokenizer's ids), got {draft_vocab_size}"
            )
        self.draft_vocab_size = draft_vocab_size
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
        self.mtp = MtpHead(cfg, dtype, device) if mtp else None
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

    @property
    def num_kv_layers(self) -> int:
        """Layers of the KV pool: the full-attention layers, then the MTP head's layer (if any)."""
        return len(self.config.full_attention_layers) + (1 if self.mtp is not None else 0)

    @property
    def mtp_kv_index(self) -> int:
        """The MTP head's layer in the KV pool: the last one."""
        return len(self.config.full_attention_layers)

    def weight_requirements(self) -> list[WeightRequirement]:
        reqs = [single("embed_tokens.weight", self.embed_tokens), single("norm.weight", self.norm)]
        if not self.config.tie_word_embeddings:
            reqs.append(single("lm_head.weight", self.lm_head))
        for i, layer in enumerate(self.layers):
            reqs += layer.weight_requirements(f"layers.{i}")
        if self.mtp is not None:
            reqs += self.mtp.weight_requirements("mtp")
        return reqs

    def forward(
        self, batch: ForwardBatch, kv: CacheLayers, states: CacheLayers, every_token: bool = False
    ) -> torch.Tensor:
        """Runs every new token of the batch; returns the final-normed hidden states of the
        `batch.logits_indices` rows, [R, hidden], or with `every_token` of every token, [T, hidden]."""
        rows = batch.num_tokens
        prefetch_weight(rows, self.layers[0].mixer.first_projection)
        h = F.embedding(batch.input_ids, self.embed_tokens)
        residual: torch.Tensor | None = None
        for i, (layer, cache_index) in enumerate(zip(self.layers, self.cache_index, strict=True)):
            # Each norm reaches its layer uncomputed: the layer's first projection may take it into its
            # GEMV (ops.normed_linear); the next residual exists once it has been computed.
            x = NormedInput(h, layer.input_layernorm, layer.eps, residual)
            after_mixer = layer.mlp.first_projection
            if layer.is_full_attention:
                h = layer.mixer(x, batch, self.inv_freq, kv.layer(cache_index), then=after_mixer)
            else:
                h = layer.mixer(x, batch, states.layer(cache_index), then=after_mixer)
            x = NormedInput(
                self.tp.all_reduce_(h), layer.post_attention_layernorm, layer.eps, x.next_residual
            )
            after_mlp = (
                self.layers[i + 1].mixer.first_projection if i + 1 < len(self.layers) else self.lm_head
            )
            h = self.tp.all_reduce_(layer.mlp(x, then=after_mlp))
            residual = x.next_residual
        if every_token:
            return rms_norm(h, self.norm, self.config.rms_norm_eps, residual)[0]
        logit_rows = batch.logits_indices
        return rms_norm(h[logit_rows], self.norm, self.config.rms_norm_eps, residual[logit_rows])[0]

    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: CacheLayers
    ) -> torch.Tensor:
        """The MTP step for every token of `batch`: `input_ids` [T] are the next tokens (token i+1 at
        row i), `hidden` [T, hidden] the target's final-normed hidden of each row (`forward(...,
        every_token=True)`); positions, slot mapping and block tables are the target forward's (its GDN
        state fields are unused). Writes the MTP layer's K and V (KV layer `mtp_kv_index`); returns the
        MTP's final-normed hidden [T, hidden], for `compute_logits`."""
        if self.mtp is None:
            raise RuntimeError("mtp_forward needs the MTP head: build the model with mtp=True")
        return self.mtp(
            input_ids, hidden, self.embed_tokens, batch, self.inv_freq, kv.layer(self.mtp_kv_index)
        )

    def compute_logits(
        self, hidden: torch.Tensor, rows: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[R, hidden] -> [rows, logits_vocab_size] float32 (rows: R by default; the GEMM runs over all
        R rows, so a caller can pad R to a row count whose GEMM kernel is already loaded). The GEMM runs
        over a width rounded up to a multiple of 64 rows of the (padded) vocabulary: an odd width like
        248077 sends cuBLAS to slow, unaligned kernels. The float32 copy is made at all R rows too (the
        result is its first `rows`): its ~1 MB per row is then allocated at a caller's padded counts, which
        the caching allocator reuses, not at a count that grows by a few rows each step of a filling server
        (a new device allocation each step, and an allocator retry, a device synchronisation, once the
        outgrown blocks fill the memory). `out` (float32 [at least R, logits_vocab_size]): the copy is
        written into its first R rows instead (the same bits), and the result is a view of it."""
        n = self.logits_vocab_size
        width = min(self.config.vocab_size, -(-n // 64) * 64)
        logits = linear(hidden, self.lm_head[:width])[:, :n]
        if out is None:
            return logits.float()[:rows]
        return out[: logits.shape[0]].copy_(logits)[:rows]

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head's greedy proposals from its final-normed hidden [R, hidden]: [R] int64 ids, the
        argmax over the first `draft_vocab_size` ids (its LM-head rows alone are read), or over every
        id of the logits."""
        if self.draft_vocab_size is None:
            return self.compute_logits(hidden).argmax(dim=-1)
        return linear(hidden, self.lm_head[: self.draft_vocab_size]).argmax(dim=-1)
