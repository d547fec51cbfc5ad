"""A checkpoint's `quantization_config`: the quantized weight formats that load (dequantized into the
serving dtype, deltaserve/model/fp8.py) and how their scales are laid out.

Both are FP8 (e4m3) weights, each beside a scale tensor that multiplies it, one scale value per block:

- quant_method "fp8" (Qwen's -FP8 releases, DeepSeek's layout): the scale of `X` is `X_scale_inv`, one
  per `weight_block_size` [rows, columns] block, or one per matrix without a block size;
- quant_method "compressed-tensors" with 8-bit float weights (llm-compressor's FP8 checkpoints, e.g.
  "FP8-dynamic"): the scale of `X` is `X_scale`, per tensor, channel (output row), group (of columns
  in a row) or block, as each config group's `weights.strategy` says.

Activations are never quantized, so a static scheme's activation scales go unused; integer, 4-bit,
asymmetric, sparse or transformed formats are refused, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.errors import ConfigError

# (rows, columns) of a weight matrix one scale value covers; None: the whole dimension.
ScaleBlock = tuple[int | None, int | None]
PER_MATRIX: ScaleBlock = (None, None)
PER_ROW: ScaleBlock = (1, None)
FP8_METHOD, COMPRESSED_TENSORS = "fp8", "compressed-tensors"


@dataclass(frozen=True, slots=True)
class WeightQuantization:
    method: str  # FP8_METHOD or COMPRESSED_TENSORS
    scale_suffix: str  # the scale of checkpoint tensor X is X + scale_suffix
    scale_blocks: tuple[ScaleBlock, ...]  # the layouts a scale may have (one per config group)
    activation_scheme: str  # "dynamic" or "static" (its activation scales are skipped)


def parse_quantization(raw: dict[str, Any], text: dict[str, Any], source: str) -> WeightQuantization | None:
    """`quantization_config` at the top level (where HF writes it, also for multimodal checkpoints) or in
    text_config; None for an unquantized checkpoint."""
    value, where = raw.get("quantization_config"), f"{source} quantization_config"
    if value is None and text is not raw:
        value, where = text.get("quantization_config"), f"{source} text_config.quantization_config"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, got {value!r}")
    method = value.get("quant_method")
    if method == FP8_METHOD:
        return _fp8(value, where)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(value, where)
    raise _fail(
        where,
        "quant_method",
        f"{FP8_METHOD!r} (Qwen's -FP8 checkpoints) or {COMPRESSED_TENSORS!r} with FP8 weights; other "
        "quantized formats are not supported: serve the bfloat16 checkpoint",
        method,
    )


def _fail(where: str, key: str, expected: str, found: Any) -> ConfigError:
    return ConfigError(f"{where}: {key} must be {expected}, got {found!r}")


def _fp8(value: dict[str, Any], where: str) -> WeightQuantization:
    if value.get("fmt", "e4m3") != "e4m3":
        raise _fail(where, "fmt", "'e4m3' (float8_e4m3fn weights)", value.get("fmt"))
    scheme = value.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _fail(where, "activation_scheme", "'dynamic' or 'static'", scheme)
    block = value.get("weight_block_size")
    if block is None:
        return WeightQuantization(FP8_METHOD, "_scale_inv", (PER_MATRIX,), scheme)
    if not (isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)):
        raise _fail(where, "weight_block_size", "two integers >= 1 ([rows, columns] of a scale block)", block)
    return WeightQuantization(FP8_METHOD, "_scale_inv", ((block[0], block[1]),), scheme)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# compressed-tensors `format` values whose FP8 weights are stored as plain float8_e4m3fn tensors.
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def _compressed_tensors(value: dict[str, Any], where: str) -> WeightQuantization:
    for key in ("sparsity_config", "transform_config"):
        if value.get(key):
            raise _fail(where, key, "empty (sparse or transformed checkpoints are not supported)", value[key])
    status = value.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail(where, "quantization_status", "'compressed'", status)
    groups = value.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail(where, "config_groups", "an object of one or more quantization groups", groups)
    blocks: list[ScaleBlock] = []
    static = False
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise _fail(at, "the group", "an object", group)
        fmt = group.get("format") or value.get("format")
        if fmt not in _FLOAT_FORMATS:
            raise _fail(at, "format", f"one of {list(_FLOAT_FORMATS)} (FP8 weights)", fmt)
        blocks.append(_compressed_weights(group.get("weights"), f"{at}.weights"))
        inputs = group.get("input_activations")
        static = static or (isinstance(inputs, dict) and inputs.get("dynamic") is False)
    return WeightQuantization(
        COMPRESSED_TENSORS, "_scale", tuple(dict.fromkeys(blocks)), "static" if static else "dynamic"
    )


def _compressed_weights(weights: Any, where: str) -> ScaleBlock:
    if not isinstance(weights, dict):
        raise ConfigError(f"{where}: must be an object describing the weights' quantization, got {weights!r}")
    kind = (weights.get("num_bits"), weights.get("type"))
    if kind != (8, "float"):
        raise _fail(
            where,
            "num_bits and type",
            "8 and 'float' (FP8 weights; integer and 4-bit formats are not supported)",
            kind,
        )
    if weights.get("symmetric", True) is not True:
        raise _fail(where, "symmetric", "true (FP8 weights have no zero point)", weights.get("symmetric"))
    strategy = weights.get("strategy")
    if strategy == "tensor":
        return PER_MATRIX
    if strategy == "channel":
        return PER_ROW
    if strategy == "group":
        size = weights.get("group_size")
        if not _positive_int(size):
            raise _fail(where, "group_size", "an integer >= 1 for strategy 'group'", size)
        return (1, size)
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)):
            raise _fail(where, "block_structure", "two integers >= 1 for strategy 'block'", block)
        return (block[0], block[1])
    raise _fail(where, "strategy", "one of ['tensor', 'channel', 'group', 'block']", strategy)
