"""Model config (parsed from a checkpoint's config.json), validated up front: it fails before anything is
loaded, with a message naming the key, the expected and the found value. The engine's flags are
deltaserve/engine_config.py."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltaserve.errors import ConfigError
from deltaserve.quant_config import WeightQuantization, parse_quantization

if TYPE_CHECKING:  # torch is imported where a dtype or device is resolved: the server's CLI starts fast
    import torch

# model_type values at the top level of config.json, and the text model_type each implies.
TEXT_MODEL_TYPES = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
}
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# HF's default when a config carries no rope information at all (official configs always do).
HF_DEFAULT_ROPE_THETA = 10000.0
DTYPES = ("float32", "bfloat16", "float16")  # names, as torch spells them
# vLLM's other spellings of the same dtypes (`--dtype half`).
DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of DTYPES."""
    import torch

    return getattr(torch, name)


def parse_dtype(name: str, *, what: str) -> torch.dtype:
    """`what` names the key or flag the value came from."""
    if name not in DTYPES:
        raise ConfigError(f"{what} must be one of {sorted(DTYPES)}, got {name!r}")
    return torch_dtype(name)


SHARDED_DENSE = (
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
SHARDED_MOE = ("moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The text model of a Qwen3.5 checkpoint (dense or MoE). Derived sizes are properties."""

    model_type: str  # "qwen3_5_text" or "qwen3_5_moe_text"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    intermediate_size: int = 0  # dense MLP width; 0 for MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mtp_num_hidden_layers: int = 0  # decoder layers of the checkpoint's MTP head (mtp.*); 0: none
    ssm_state_dtype: str = "float32"  # `mamba_ssm_dtype`
    checkpoint_dtype: str = "bfloat16"
    weight_quantization: WeightQuantization | None = None  # `quantization_config`; None: unquantized
    eos_token_ids: tuple[int, ...] = ()
    architectures: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def kv_bytes_per_token(self, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """KV cache bytes one token occupies over `num_layers` KV layers (default: the full-attention
        layers; the GDN layers hold none. The MTP head's layer adds one)."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * dtype.itemsize
        return per_layer * (len(self.full_attention_layers) if num_layers is None else num_layers)

    def state_bytes_per_sequence(self, conv_dtype: torch.dtype) -> int:
        """Recurrent state one sequence holds over all GDN layers: conv window + SSM state."""
        conv = self.conv_dim * (self.linear_conv_kernel_dim - 1) * conv_dtype.itemsize
        ssm = (
            self.linear_num_value_heads
            * self.linear_key_head_dim
            * self.linear_value_head_dim
            * torch_dtype(self.ssm_state_dtype).itemsize
        )
        return (conv + ssm) * len(self.linear_attention_layers)

    def shard(self, tp_size: int) -> ModelConfig:
        """The per-rank geometry under `tp_size`-way tensor parallelism: heads, kv heads, GDN key and
        value heads and MLP/expert widths divided by `tp_size` (deltaserve.model.layers.parallel)."""
        if tp_size == 1:
            return self
        sharded = SHARDED_DENSE + (SHARDED_MOE if self.is_moe else ("intermediate_size",))
        changes = {}
        for name in sharded:
            value = getattr(self, name)
            if value % tp_size:
                raise ConfigError(
                    f"--tensor-parallel-size {tp_size} must divide the model's {name}, got {name}={value}"
                )
            changes[name] = value // tp_size
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json found; --model must be a checkpoint directory")
        raw = _read_json(path)
        eos = _generation_eos(model_dir / "generation_config.json")
        return cls.from_dict(raw, eos_token_ids=eos, source=str(path))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, eos_token_ids: tuple[int, ...] | None = None, source: str = "config.json"
    ) -> ModelConfig:
        return _parse(raw, eos_token_ids, source)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _generation_eos(path: Path) -> tuple[int, ...] | None:
    if not path.is_file():
        return None
    eos = _read_json(path).get("eos_token_id")
    if eos is None:
        return None
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


# generation_config.json keys read as request defaults (vLLM's `--generation-config auto`), with the
# SamplingParams field each becomes.
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(path: Path) -> dict[str, float | int]:
    """The sampling defaults a checkpoint ships in generation_config.json (Qwen3.5: temperature, top_p,
    top_k): what a request that omits these fields gets. Other keys (eos, do_sample, ...) are not
    sampling defaults. A missing file has none."""
    if not path.is_file():
        return {}
    return sampling_defaults(_read_json(path), str(path))


def sampling_defaults(
    data: dict[str, Any], where: str, *, only_sampling_keys: bool = False
) -> dict[str, float | int]:
    """The GENERATION_SAMPLING_KEYS of a generation config object, typed; with `only_sampling_keys`, any
    other key is refused (an override that names one would otherwise be silently dropped)."""
    k = _Keys(data, where)
    unknown = sorted(set(data) - set(GENERATION_SAMPLING_KEYS)) if only_sampling_keys else []
    if unknown:
        raise ConfigError(f"{where}: keys must be among {list(GENERATION_SAMPLING_KEYS)}, got {unknown[0]!r}")
    defaults: dict[str, float | int] = {}
    for key in GENERATION_SAMPLING_KEYS:
        if k.has(key):
            defaults[key] = k.int(key, minimum=-1) if key == "top_k" else k.float(key)
    return defaults


class _Keys:
    """Typed access to one JSON object, with errors that name the file and key."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def fail(self, key: str, expected: str, found: Any) -> ConfigError:
        return ConfigError(f"{self.where}: {key} must be {expected}, got {found!r}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def int(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise ConfigError(f"{self.where}: missing required key {key!r} (an integer >= {minimum})")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"an integer >= {minimum}", value)
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.data.get(key, default)
        if value is None:
            raise ConfigError(f"{self.where}: missing required key {key!r} (a number)")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(key, "a finite number", value)
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def str(self, key: str, default: str | None = None) -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, "a string", value)
        return value


def _parse(raw: dict[str, Any], eos_override: tuple[int, ...] | None, source: str) -> ModelConfig:
    top_type = raw.get("model_type")
    if top_type not in TEXT_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type must be one of {sorted(TEXT_MODEL_TYPES)} (a Qwen3.5 checkpoint), "
            f"got {top_type!r}"
        )
    text = raw
    where = source
    if top_type in ("qwen3_5", "qwen3_5_moe"):
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type {top_type!r} needs a text_config object, got {text!r}")
        where = f"{source} text_config"
        text_type = text.get("model_type", TEXT_MODEL_TYPES[top_type])
        if text_type != TEXT_MODEL_TYPES[top_type]:
            raise ConfigError(
                f"{where}: model_type must be {TEXT_MODEL_TYPES[top_type]!r} under a {top_type!r} "
                f"config, got {text_type!r}"
            )
    k = _Keys(text, where)
    # A few keys live at the top level of official multimodal configs only.
    top = _Keys(raw, source)

    model_type = TEXT_MODEL_TYPES[top_type]
    num_layers = k.int("num_hidden_layers")
    layer_types = _layer_types(k, num_layers)
    theta, partial = _rope(k, top)
    hidden_act = k.str("hidden_act", "silu")
    if hidden_act != "silu":
        raise k.fail("hidden_act", "'silu'", hidden_act)
    if not k.bool("attn_output_gate", True):
        raise k.fail("attn_output_gate", "true (Qwen3.5 attention always has the output gate)", False)
    if k.bool("attention_bias", False):
        raise k.fail("attention_bias", "false (Qwen3.5 has no attention biases)", True)
    ssm_dtype = k.str("mamba_ssm_dtype", "float32")
    parse_dtype(ssm_dtype, what=f"{where}: mamba_ssm_dtype")
    ckpt_dtype = k.str("dtype", None) if k.has("dtype") else k.data.get("torch_dtype") or "bfloat16"
    if not isinstance(ckpt_dtype, str) or ckpt_dtype not in DTYPES:
        raise k.fail("dtype", f"one of {sorted(DTYPES)}", ckpt_dtype)
    tie = k.bool("tie_word_embeddings", top.data.get("tie_word_embeddings", False))

    is_moe = model_type == "qwen3_5_moe_text"
    moe: dict[str, Any] = {}
    if is_moe:
        if k.data.get("mlp_only_layers"):
            raise k.fail(
                "mlp_only_layers", "empty (every Qwen3.5 MoE layer is sparse)", k.data["mlp_only_layers"]
            )
        moe = {
            "num_experts": k.int("num_experts"),
            "num_experts_per_tok": k.int("num_experts_per_tok"),
            "moe_intermediate_size": k.int("moe_intermediate_size"),
            "shared_expert_intermediate_size": k.int("shared_expert_intermediate_size"),
            "norm_topk_prob": k.bool("norm_topk_prob", True),
        }
        if moe["num_experts_per_tok"] > moe["num_experts"]:
            raise k.fail(
                "num_experts_per_tok", f"<= num_experts ({moe['num_experts']})", moe["num_experts_per_tok"]
            )
    else:
        moe = {"intermediate_size": k.int("intermediate_size")}

    eos = eos_override
    if eos is None:
        value = k.data.get("eos_token_id", top.data.get("eos_token_id"))
        eos = () if value is None else tuple(value) if isinstance(value, list) else (value,)

    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=k.int("vocab_size"),
        hidden_size=k.int("hidden_size"),
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=k.int("num_attention_heads"),
        num_key_value_heads=k.int("num_key_value_heads"),
        head_dim=k.int("head_dim"),
        linear_num_key_heads=k.int("linear_num_key_heads"),
        linear_num_value_heads=k.int("linear_num_value_heads"),
        linear_key_head_dim=k.int("linear_key_head_dim"),
        linear_value_head_dim=k.int("linear_value_head_dim"),
        linear_conv_kernel_dim=k.int("linear_conv_kernel_dim", 4),
        rms_norm_eps=k.float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        partial_rotary_factor=partial,
        max_position_embeddings=k.int("max_position_embeddings", top.data.get("max_position_embeddings")),
        tie_word_embeddings=tie,
        mtp_num_hidden_layers=k.int("mtp_num_hidden_layers", 0, minimum=0),
        ssm_state_dtype=ssm_dtype,
        checkpoint_dtype=ckpt_dtype,
        weight_quantization=parse_quantization(raw, text, source),
        eos_token_ids=tuple(int(e) for e in eos),
        architectures=tuple(raw.get("architectures") or ()),
        **moe,
    )
    _check_consistency(cfg, k)
    return cfg


def _layer_types(k: _Keys, num_layers: int) -> tuple[str, ...]:
    if k.has("layer_types"):
        types = k.data["layer_types"]
        if not isinstance(types, list) or len(types) != num_layers:
            found = len(types) if isinstance(types, list) else types
            raise k.fail("layer_types", f"a list of num_hidden_layers ({num_layers}) entries", found)
        for i, t in enumerate(types):
            if t not in (LINEAR_ATTENTION, FULL_ATTENTION):
                raise k.fail(f"layer_types[{i}]", f"{LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}", t)
        return tuple(types)
    interval = k.int("full_attention_interval", 4)
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def _rope(k: _Keys, top: _Keys) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters`, or the legacy top-level keys."""
    params = k.data.get("rope_parameters")
    if params is None:
        params = k.data.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise k.fail("rope_scaling", "an object or null", params)
        params = dict(params)
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in params and (k.has(key) or top.has(key)):
                params[key] = k.data.get(key, top.data.get(key))
    if not isinstance(params, dict):
        raise k.fail("rope_parameters", "an object", params)
    rope = _Keys(params, f"{k.where} rope_parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise rope.fail("rope_type", "'default' (rope scaling is not supported)", rope_type)
    theta = rope.float("rope_theta", HF_DEFAULT_ROPE_THETA)
    partial = rope.float("partial_rotary_factor", k.data.get("partial_rotary_factor", 1.0))
    if not 0.0 < partial <= 1.0:
        raise rope.fail("partial_rotary_factor", "in (0, 1]", partial)
    return theta, partial


def _check_consistency(cfg: ModelConfig, k: _Keys) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise k.fail(
            "num_attention_heads",
            f"a multiple of num_key_value_heads ({cfg.num_key_value_heads})",
            cfg.num_attention_heads,
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise k.fail(
            "linear_num_value_heads",
            f"a multiple of linear_num_key_heads ({cfg.linear_num_key_heads})",
            cfg.linear_num_value_heads,
        )
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise k.fail(
            "linear_value_head_dim",
            f"equal to linear_key_head_dim ({cfg.linear_key_head_dim})",
            cfg.linear_value_head_dim,
        )
    if cfg.linear_conv_kernel_dim < 2:
        raise k.fail("linear_conv_kernel_dim", "an integer >= 2", cfg.linear_conv_kernel_dim)
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise k.fail(
            "partial_rotary_factor",
            f"a value giving an even rotary dimension >= 2 of head_dim {cfg.head_dim}",
            cfg.partial_rotary_factor,
        )
    if not cfg.full_attention_layers:
        raise k.fail("layer_types", "at least one 'full_attention' layer", list(cfg.layer_types))
    for e in cfg.eos_token_ids:
        if not 0 <= e < cfg.vocab_size:
            raise ConfigError(f"{k.where}: eos_token_id {e} is outside the vocabulary [0, {cfg.vocab_size})")
