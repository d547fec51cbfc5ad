"""HF transformers as the correctness oracle: small random Qwen3.5 models saved in every layout we load.

Norm weights are randomised too (a (1 + w) vs w bug is invisible with HF's zero/one init), and weights
are scaled so logits spread over several nats (a near-uniform distribution would hide errors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROPE = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [1, 1, 2],
    "mrope_interleaved": True,
}


def text_config_kwargs(
    *, attn_group: int = 2, gdn_group: int = 2, tied: bool = True, moe: bool = False, layers: int = 8
) -> dict:
    kv_heads = 2
    kw = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads * attn_group,
        num_key_value_heads=kv_heads,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2 * gdn_group,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        rope_parameters=dict(ROPE),
        eos_token_id=511,
    )
    if moe:
        kw.update(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
    else:
        kw.update(intermediate_size=128)
    return kw


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.0, 1.5, generator=gen))
        elif name.endswith("dt_bias"):
            normal(p, 0.5, 1.0)
        elif name.endswith("linear_attn.norm.weight"):
            normal(p, 0.2, 1.0)
        elif p.dim() == 1:
            normal(p, 0.2)
        elif "embed_tokens" in name:
            normal(p, 0.3)
        else:
            fan_in = p.shape[-1]
            normal(p, 1.0 / fan_in**0.5)


def build_hf_causal_lm(seed: int = 0, **kwargs) -> torch.nn.Module:
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    moe = kwargs.get("moe", False)
    kw = text_config_kwargs(**kwargs)
    torch.manual_seed(seed)
    if moe:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw))
    randomise(model, seed)
    return model.eval()


def save_text_layout(model: torch.nn.Module, out: Path) -> Path:
    """HF's own save: `model.layers.*` names, per-expert MoE tensors."""
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_official_layout(model: torch.nn.Module, out: Path, *, fused_experts: bool = True) -> Path:
    """The official multimodal layout, written by HF's Qwen3_5(Moe)ForConditionalGeneration with a tiny
    vision tower, plus `mtp.*` tensors the text model must skip; MoE experts re-packed into the official
    fused 3-D tensors when `fused_experts`."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    text = model.config.to_dict()
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"]
    )
    moe = "num_experts" in text and text.get("num_experts")
    cls, cfg_cls = (
        (Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig)
        if moe
        else (Qwen3_5ForConditionalGeneration, Qwen3_5Config)
    )
    vlm = cls(
        cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])
    )
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in model.state_dict().items()}
    missing, unexpected = vlm.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith("model.visual.") for k in missing), missing
    vlm.save_pretrained(out, safe_serialization=True)

    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(str(files[0]))
    assert any(k.startswith("model.visual.") for k in tensors)
    hidden = text["hidden_size"]
    gen = torch.Generator().manual_seed(1234)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
    tensors["mtp.norm.weight"] = torch.randn(hidden, generator=gen)
    tensors["mtp.layers.0.self_attn.k_proj.weight"] = torch.randn(64, hidden, generator=gen)
    if moe and fused_experts:
        tensors = fuse_experts(tensors, text["num_experts"])
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    return out


def fuse_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> official `experts.gate_up_proj` [E, 2I, H]
    and `experts.down_proj` [E, H, I]; an FP8 checkpoint's `.weight_scale_inv` likewise, to
    `experts.gate_up_proj_scale_inv` and `experts.down_proj_scale_inv` (gate's scale rows, then up's)."""
    out: dict[str, torch.Tensor] = {}
    prefixes = sorted({k.split(".experts.")[0] for k in tensors if ".experts.0.gate_proj.weight" in k})
    for name, t in tensors.items():
        if ".experts." not in name or any(f".experts.{s}" in name for s in ("gate_up_proj", "down_proj")):
            out[name] = t
    for p in prefixes:
        e = f"{p}.experts"
        for suffix, fused in (("weight", ""), ("weight_scale_inv", "_scale_inv")):
            if f"{e}.0.gate_proj.{suffix}" not in tensors:
                continue
            out[f"{e}.gate_up_proj{fused}"] = torch.stack(
                [
                    torch.cat([tensors[f"{e}.{i}.gate_proj.{suffix}"], tensors[f"{e}.{i}.up_proj.{suffix}"]])
                    for i in range(num_experts)
                ]
            )
            out[f"{e}.down_proj{fused}"] = torch.stack(
                [tensors[f"{e}.{i}.down_proj.{suffix}"] for i in range(num_experts)]
            )
    return out


@torch.no_grad()
def hf_incremental_logprobs(
    model: torch.nn.Module, prompt: list[int], steps: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `prompt`, then `steps` greedy decode steps through HF's cache. Returns the log-probs
    [vocab] after the prompt and after each decoded token, and the greedy tokens."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    logprobs = [out.logits[0, -1].float().log_softmax(-1)]
    tokens: list[int] = []
    past = out.past_key_values
    for _ in range(steps):
        tokens.append(int(logprobs[-1].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logprobs.append(out.logits[0, -1].float().log_softmax(-1))
    return logprobs, tokens


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(w: torch.Tensor, block: tuple[int | None, int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 of a matrix: (float8_e4m3fn weight, fp32 scale per block, [ceil(N / bn),
    ceil(K / bk)]), each block's amax mapped to FP8_MAX; a None block dimension spans the matrix."""
    (n, k), (bn, bk) = w.shape, (block[0] or w.shape[0], block[1] or w.shape[1])
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows * bn, cols * bk)
    return q[:n, :k].contiguous(), scale


def fp8_config(block: tuple[int, int]) -> dict:
    """Qwen's -FP8 quantization_config: `<name>_scale_inv` per block."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }


def compressed_tensors_config(weights: dict) -> dict:
    """llm-compressor's FP8 quantization_config (compressed-tensors, `<name>_scale`); `weights` gives the
    strategy (and group_size or block_structure)."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": {
                    "dynamic": True,
                    "num_bits": 8,
                    "strategy": "token",
                    "symmetric": True,
                    "type": "float",
                },
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "dynamic": False,
                    "num_bits": 8,
                    "observer": "minmax",
                    "symmetric": True,
                    "type": "float",
                    **weights,
                },
            }
        },
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def quantize_checkpoint(
    model_dir: Path, block: tuple[int | None, int | None], quantized, config: dict, suffix: str = "_scale_inv"
) -> list[str]:
    """Rewrites a saved checkpoint as a quantized one: every 2-D tensor whose name `quantized(name)`
    accepts becomes FP8 + `<name><suffix>`, and config.json gets `config` as its quantization_config.
    Returns the names."""
    files = sorted(model_dir.glob("*.safetensors"))
    done: list[str] = []
    for path in files:
        tensors = load_file(str(path))
        for name in [n for n, t in tensors.items() if t.dim() == 2 and quantized(n)]:
            tensors[name], tensors[name + suffix] = quantize_fp8(tensors[name], block)
            done.append(name)
        save_file(tensors, str(path), metadata={"format": "pt"})
    model_config = read_config(model_dir)
    model_config["quantization_config"] = config
    (model_dir / "config.json").write_text(json.dumps(model_config, indent=2))
    return done


def is_linear_weight(name: str) -> bool:
    """The projections an FP8 checkpoint quantizes (not the embedding, LM head, norms or conv)."""
    return (
        name.endswith("proj.weight")
        or ".in_proj_" in name
        or name.endswith(("mlp.gate.weight", "_gate.weight"))
    )
