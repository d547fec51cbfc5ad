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


def decode_row_logits(preset: str) -> torch.Tensor:
    cfg = ModelConfig.from_dict(text_config(preset))
    torch.manual_seed(0)
    model = qwen35.Qwen35ForCausalLM(cfg, dtype=torch.bfloat16, device=torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    caches = build_device_caches(
        cfg, num_pages=16, page_size=4, num_slots=2, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    cache = CacheManager.for_device(caches)
    backend = Backend(model, caches)
    seq = cache.open()
    cache.reserve(seq, 3)
    backend.logits([BatchRow([5, 6], 0, seq.pages, seq.slot)])
    cache.advance(seq, 2)
    return backend.logits([BatchRow([7], 2, seq.pages, seq.slot)])
