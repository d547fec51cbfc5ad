"""One decode row's logits from a small bf16 model on the CPU, after a two-token prefill: for tests that
compare a forward with an op path switched on against the same forward with it off."""

from __future__ import annotations

import torch

from deltaserve.cache.device import build_device_caches
from deltaserve.cache.manager import CacheManager
from deltaserve.config import ModelConfig
from deltaserve.engine.backend import Backend
from deltaserve.model import qwen35
from deltaserve.ops.batch import BatchRow
from deltaserve.tiny import text_config

CPU = torch.device("cpu")


def after_two_tokens(
    preset: str,
    dtype: torch.dtype,
    std: float,
    *,
    device: torch.device = CPU,
    layers: int | None = None,
    fan_in: bool = False,
) -> tuple[Backend, BatchRow]:
    """A `preset` model of random weights (normal, `std`; with `fan_in` a matrix's std is 1 / sqrt(its
    columns), so that wide layers keep their activations in range) on `device`, cut to its first `layers`
    layers if given, with one sequence whose two-token prompt is prefilled: its backend and the sequence's
    next decode row."""
    config = text_config(preset)
    if layers is not None:
        config = {**config, "num_hidden_layers": layers, "layer_types": config["layer_types"][:layers]}
    cfg = ModelConfig.from_dict(config)
    model = qwen35.Qwen35ForCausalLM(cfg, dtype=dtype, device=device)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5 if fan_in and p.dim() == 2 else std)
    caches = build_device_caches(cfg, num_pages=16, page_size=4, num_slots=2, dtype=dtype, device=device)
    cache = CacheManager.for_device(caches)
    backend = Backend(model, caches)
    seq = cache.open()
    cache.reserve(seq, 8)
    backend.logits([BatchRow([5, 6], 0, seq.pages, seq.slot)])
    cache.advance(seq, 2)
    return backend, BatchRow([7], 2, seq.pages, seq.slot)


def decode_row_logits(preset: str) -> torch.Tensor:
    torch.manual_seed(0)
    backend, row = after_two_tokens(preset, torch.bfloat16, 0.2)
    return backend.logits([row])
