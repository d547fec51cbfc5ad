"""safetensors loader: official Qwen3.5 layout and HF text layout, plus random (dummy) weights.

Checkpoint names are canonicalised to the HF text layout before matching:
  model.language_model.X -> X  (official multimodal checkpoints)
  model.X -> X                 (HF text-only checkpoints)
  lm_head.weight -> lm_head.weight
  mtp.X, model.mtp.X -> mtp.X     (the MTP head; skipped unless the model has one)
The vision tower (model.visual.*) and rotary buffers are skipped. Every tensor is copied straight into
its parameter view (one checkpoint tensor in host memory at a time); a missing, unexpected or
misshaped tensor fails with its name and both shapes. FP8 checkpoints (`quantization_config`
quant_method "fp8") load dequantized into the model's dtype: each FP8 weight with its
scale (deltaserve.quant_config, deltaserve.model.fp8), and unused activation/KV scales are skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from deltaserve.errors import ConfigError
from deltaserve.model import fp8
from deltaserve.model.layers.params import CheckpointTensor
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.quant_config import WeightQuantization

logger = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIXES = ("mtp.", "model.mtp.")


def canonical_name(name: str, *, mtp: bool = False) -> str | None:
    """The HF-text-layout name of a checkpoint tensor, or None when the engine does not use it (the
    MTP head's tensors are used when `mtp`)."""
    if name.startswith(SKIPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith(MTP_PREFIXES):
        return name[name.index("mtp.") :] if mtp else None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{index}: expected a 'weight_map' object")
    return weight_map


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files (or model.safetensors.index.json) found")
    return files


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor of a checkpoint: where it is stored (for messages) and how to read it."""

    where: str
    read: Callable[[], torch.Tensor]


@contextlib.contextmanager
def open_checkpoint(model_dir: Path) -> Iterator[dict[str, StoredTensor]]:
    """Every tensor of a checkpoint by name, in file order, with every file open until the block
    exits: a tensor can be read while another (in any file) is handled, and only then."""
    with contextlib.ExitStack() as files:
        tensors: dict[str, StoredTensor] = {}
        for path in checkpoint_files(model_dir):
            f = files.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                tensors[name] = StoredTensor(path.name, partial(f.get_tensor, name))
        yield tensors


def checkpoint_has_mtp(model_dir: str | Path) -> bool:
    """Whether the checkpoint ships an MTP head (tensors named mtp.*), from its index or the files'
    headers only (no tensor is read)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return any(name.startswith(MTP_PREFIXES) for name in _weight_map(index))
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if any(name.startswith(MTP_PREFIXES) for name in f.keys()):  # noqa: SIM118 - not a mapping
                return True
    return False


@torch.inference_mode()
def load_weights(model: Qwen35ForCausalLM, model_dir: str | Path) -> None:
    model_dir = Path(model_dir)
    with open_checkpoint(model_dir) as tensors:
        load_tensors(model, tensors, str(model_dir))


@torch.inference_mode()
def load_state_dict(
    model: Qwen35ForCausalLM, state: dict[str, torch.Tensor], source: str = "state dict"
) -> None:
    """Loads an in-memory HF state dict (e.g. a transformers model's), same rules as a checkpoint."""
    load_tensors(
        model, {name: StoredTensor(source, partial(state.__getitem__, name)) for name in state}, source
    )


def load_tensors(model: Qwen35ForCausalLM, tensors: Mapping[str, StoredTensor], source: str) -> None:
    """Copies every tensor the model uses into its parameter views, one at a time; FP8 weights are
    dequantized with their scales on the way (deltaserve.model.fp8)."""
    requirements = model.weight_requirements()
    by_name: dict[str, CheckpointTensor] = {}
    for req in requirements:
        for alternative in req.alternatives:
            for tensor in alternative:
                by_name[tensor.name] = tensor
    loaded: set[str] = set()
    unexpected: list[str] = []
    tied = model.config.tie_word_embeddings
    mtp = model.mtp is not None
    quant = model.config.weight_quantization
    dequantized = 0
    for name, stored in tensors.items():
        canonical = canonical_name(name, mtp=mtp)
        if canonical is None or (tied and canonical == "lm_head.weight"):
            continue
        if quant is not None and _is_sidecar(name, tensors, quant):
            continue
        spec = by_name.get(canonical)
        if spec is None:
            unexpected.append(name)
            continue
        tensor = _read_weight(name, stored, tensors, quant, spec.target, source)
        if tuple(tensor.shape) != spec.full_shape:
            raise ConfigError(
                f"{stored.where}: tensor {name} has shape {list(tensor.shape)}, the config implies "
                f"{list(spec.full_shape)}"
            )
        spec.copy_from(tensor)
        loaded.add(canonical)
        dequantized += quant is not None and name + quant.scale_suffix in tensors
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (
            f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        )
        raise ConfigError(f"{source}: checkpoint tensors the Qwen3.5 model does not have: {shown}")
    missing: list[str] = []
    for req in requirements:
        if any(all(t.name in loaded for t in alt) for alt in req.alternatives):
            continue
        # Report the alternative the checkpoint got furthest with (the official one when none started).
        best = max(req.alternatives, key=lambda alt: sum(t.name in loaded for t in alt))
        missing += [t.name for t in best if t.name not in loaded]
    if dequantized:
        logger.info(
            "%s: %d FP8 weights (%s, scales per %s block) dequantized to %s at load",
            source,
            dequantized,
            quant.method,
            " or ".join(fp8.describe(b) for b in quant.scale_blocks),
            model.dtype,
        )
    if not missing:
        return
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    if mtp and not any(name.startswith("mtp.") for name in loaded):
        raise ConfigError(
            f"{source}: the checkpoint has no MTP weights (mtp.*); --speculative-config method 'mtp' needs "
            f"them (missing: {shown})"
        )
    raise ConfigError(f"{source}: checkpoint is missing tensors: {shown}")


def _is_sidecar(name: str, tensors: Mapping[str, StoredTensor], quant: WeightQuantization) -> bool:
    """A weight's scale (read with its weight) or an unused activation/KV scale."""
    if name.endswith(quant.scale_suffix) and name.removesuffix(quant.scale_suffix) in tensors:
        return True  # a scale without its weight is unexpected
    return name.endswith(fp8.UNUSED_SUFFIXES)


def _read_weight(
    name: str,
    stored: StoredTensor,
    tensors: Mapping[str, StoredTensor],
    quant: WeightQuantization | None,
    target: torch.Tensor,
    source: str,
) -> torch.Tensor:
    """The tensor `name` as the model uses it: dequantized to `target`'s dtype, on its device, when the
    checkpoint stores it in FP8 with a scale."""
    dtype, device = target.dtype, target.device
    tensor = stored.read()
    scale = tensors.get(name + quant.scale_suffix) if quant is not None else None
    if not fp8.is_fp8(tensor):
        if scale is not None:
            raise ConfigError(
                f"{stored.where}: tensor {name} has a scale ({name}{quant.scale_suffix}) but dtype "
                f"{tensor.dtype}; a quantized weight is {fp8.FP8_WEIGHT_DTYPE}"
            )
        return tensor
    if quant is None:
        raise ConfigError(
            f"{stored.where}: tensor {name} has dtype {tensor.dtype}, but config.json has no "
            "quantization_config (an FP8 checkpoint declares its quant_method)"
        )
    if scale is None:
        raise ConfigError(
            f"{stored.where}: FP8 tensor {name} has no scale {name}{quant.scale_suffix} in {source}"
        )
    try:
        return fp8.dequantize(tensor.to(device), scale.read().to(device), quant, dtype)
    except ValueError as e:
        raise ConfigError(f"{stored.where}: FP8 tensor {name} {e}") from e


@torch.inference_mode()
def init_dummy_weights(model: Qwen35ForCausalLM, seed: int = 0) -> None:
    """Random weights of the right shapes (for benchmarks), generated per checkpoint tensor from (seed,
    tensor name) at the tensor's full shape and then sharded like a loaded checkpoint: a tensor-parallel
    rank holds exactly its part of the single-rank model. Linears N(0, 0.02), the embedding
    N(0, 1/hidden), zero-centred norm weights N(0, 0.1), the GDN gated norm 1 + N(0, 0.1),
    A_log = log U(1, 16), dt_bias = 1. The MTP head's tensors (when the model has one) follow the same
    rules by name."""
    for req in model.weight_requirements():
        for spec in req.alternatives[0]:  # the official layout's tensors
            spec.copy_from(
                _dummy_tensor(spec.name, spec.full_shape, seed, spec.target.dtype, spec.target.device)
            )


def _dummy_tensor(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    out = torch.empty(shape, dtype=dtype, device=device)  # one full tensor at a time, in the model's dtype
    if name.endswith("A_log"):
        return out.uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        return out.fill_(1.0)
    if len(shape) == 1:
        out.normal_(0.0, 0.1, generator=gen)
        return out.add_(1.0) if name.endswith("linear_attn.norm.weight") else out
    std = 1.0 / math.sqrt(shape[1]) if name == "embed_tokens.weight" else 0.02
    return out.normal_(0.0, std, generator=gen)
