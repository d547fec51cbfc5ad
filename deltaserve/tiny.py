"""Builds complete official-layout Qwen3.5 checkpoints with random weights and the real tokenizer.

`deltaserve make-tiny DIR --preset tiny|tiny-moe|0.8b-shape --seed N` writes what a downloaded Qwen3.5
repository holds: config.json (multimodal wrapper with text_config), model.safetensors
(`model.language_model.*` names and a complete MTP head under `mtp.*`: fc, its norms and one
full-attention decoder layer with a dense MLP or MoE block, as the official checkpoints ship it),
generation_config.json, tokenizer.json and tokenizer_config.json with the chat template. Every weight is random, norm weights
included, and the output is byte-identical for a given preset and seed. The embedded default model is
the `tiny` preset, built once into the cache directory.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltaserve.cachedir import build_once
from deltaserve.config import ModelConfig
from deltaserve.tokenizer_build import cached_tokenizer_dir

if TYPE_CHECKING:  # torch is imported when weights are made: the CLI's parser reads PRESETS from here
    import torch

RECIPE_VERSION = 3  # 2: a complete MTP head (was placeholder mtp.* tensors); 3: the same bits on any CPU
VOCAB_SIZE = 248320  # the checkpoint's padded vocabulary; the tokenizer's id space is 248077
EOS_TOKEN_IDS = [248046, 248044]  # <|im_end|>, <|endoftext|>
ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_act": "silu",
    "attn_output_gate": True,
    "attention_bias": False,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": ROPE,
    "partial_rotary_factor": 0.25,
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "eos_token_id": 248044,
    "dtype": "bfloat16",
}
# The small geometry both tiny presets share (key order kept: it is written into config.json).
_TINY_BODY = {
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "qwen3_5_text",
        **_TINY_BODY,
        "intermediate_size": 384,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    },
    "tiny-moe": {
        "model_type": "qwen3_5_moe_text",
        **_TINY_BODY,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
    },
    # Real shapes (reference/qwen35-arch.md 1.2), for benchmarks with --load-format dummy.
    "0.8b-shape": {
        "model_type": "qwen3_5_text",
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 3584,
        "tie_word_embeddings": True,
    },
    "4b-shape": {
        "model_type": "qwen3_5_text",
        "hidden_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 9216,
        "tie_word_embeddings": True,
    },
    "9b-shape": {
        "model_type": "qwen3_5_text",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    "27b-shape": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 17408,
        "tie_word_embeddings": False,
    },
    "35b-a3b-shape": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    },
}


RANDOM_WEIGHTS_NOTE = (
    "note: no model given; using the embedded tiny checkpoint, whose weights are RANDOM (its text is noise)"
)


def text_config(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = {**_COMMON, **PRESETS[preset]}
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return cfg


def official_config(preset: str) -> dict[str, Any]:
    text = text_config(preset)
    moe = text["model_type"] == "qwen3_5_moe_text"
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 64, "out_hidden_size": text["hidden_size"]},
    }


def random_text_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under official checkpoint names (bf16; A_log fp32): linears N(0, 1/fan_in),
    embeddings N(0, 0.3^2), zero-centred norm weights N(0, 0.2^2), gated norm weights 1 + N(0, 0.2^2),
    A_log = log U(1, 16), dt_bias N(1, 0.5^2). MoE experts in the official fused 3-D form. The MTP
    head (top-level `mtp.*` names) by the same rules."""
    import torch

    from deltaserve.model.qwen35 import Qwen35ForCausalLM

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        # Box-Muller over float64 uniforms: the uniforms are exact on every CPU, and the transform's
        # last-ulp differences between vectorised libms vanish in the bf16 rounding. (torch.randn's
        # float32 samples differ between AVX2 and AVX-512 builds of its kernels.)
        u1 = torch.rand(shape, generator=gen, dtype=torch.float64)
        u2 = torch.rand(shape, generator=gen, dtype=torch.float64)
        z = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)
        return z * std + mean

    with torch.inference_mode():
        gen = torch.Generator().manual_seed(seed)
        model = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=torch.device("meta"), mtp=True)
        tensors: dict[str, torch.Tensor] = {}
        for req in model.weight_requirements():
            for spec in req.alternatives[0]:  # the first alternative is the official layout
                shape = tuple(spec.target.shape)
                name = spec.name
                leaf = name.rsplit(".", 1)[-1]
                if leaf == "A_log":
                    t = torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen, dtype=torch.float64))
                elif leaf == "dt_bias":
                    t = normal(shape, 0.5, 1.0)
                elif name.endswith("linear_attn.norm.weight"):
                    t = normal(shape, 0.2, 1.0)
                elif len(shape) == 1:
                    t = normal(shape, 0.2)
                elif name == "embed_tokens.weight":
                    t = normal(shape, 0.3)
                else:
                    t = normal(shape, shape[-1] ** -0.5)
                dtype = torch.float32 if leaf == "A_log" else torch.bfloat16
                top_level = name == "lm_head.weight" or name.startswith("mtp.")
                tensors[("" if top_level else "model.language_model.") + name] = t.to(dtype).contiguous()
        return tensors


def make_tiny(out_dir: str | Path, preset: str = "tiny", seed: int = 0, *, weights: bool = True) -> Path:
    """Writes the checkpoint; without `weights` only the configs and tokenizer (serve it with
    --load-format dummy: the real-shape presets are benchmarked that way)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = official_config(preset)
    model_cfg = ModelConfig.from_dict(config, eos_token_ids=tuple(EOS_TOKEN_IDS))
    if weights:
        from safetensors.torch import save_file

        tensors = random_text_weights(model_cfg, seed)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 248044, "eos_token_id": EOS_TOKEN_IDS, "pad_token_id": 248044}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer_dir = cached_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    (out / "README.md").write_text(
        f"# deltaserve {preset} (random weights, seed {seed})\n\n"
        "Built by `deltaserve make-tiny`: the official Qwen3.5 layout and tokenizer with RANDOM weights.\n"
        "Its text is noise; it exists to run and test the engine without downloading a model.\n"
    )
    return out


def default_model_dir() -> Path:
    """The embedded default checkpoint (`tiny`, seed 0), built once into the cache directory."""
    return build_once(f"tiny-r{RECIPE_VERSION}-seed0", lambda d: make_tiny(d, "tiny", 0))
