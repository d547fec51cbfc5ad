"""Drives the model through the backend with explicit per-step items, as tests of the model need."""

from __future__ import annotations

from pathlib import Path

import torch
from driver import Driver, StepItem

from deltaserve.cache.device import build_device_caches
from deltaserve.cache.manager import CacheManager, SequenceCache
from deltaserve.config import ModelConfig
from deltaserve.engine.backend import Backend
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import load_weights


class Harness:
    def __init__(
        self,
        model_dir: Path,
        *,
        page_size: int = 4,
        num_pages: int = 512,
        num_slots: int = 8,
        ssm_dtype: torch.dtype | None = None,
    ) -> None:
        cfg = ModelConfig.from_dir(model_dir)
        device = torch.device("cpu")
        self.model = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=device)
        load_weights(self.model, model_dir)
        self.caches = build_device_caches(
            cfg,
            num_pages=num_pages,
            page_size=page_size,
            num_slots=num_slots,
            dtype=torch.float32,
            device=device,
            ssm_dtype=ssm_dtype,
        )
        self.cache = CacheManager.for_device(self.caches)
        self.backend = Driver(Backend(self.model, self.caches), self.cache)

    def open(self) -> SequenceCache:
        return self.cache.open()

    def step(self, items: list[tuple[SequenceCache, list[int]]]) -> torch.Tensor:
        """One forward; returns log-probs [len(items), vocab] of each item's last token."""
        logits = self.backend.forward([StepItem(seq, toks) for seq, toks in items], all_logits=True)
        return logits.log_softmax(-1)

    def prefill(self, seq: SequenceCache, prompt: list[int], chunk: int) -> torch.Tensor:
        out = None
        for start in range(0, len(prompt), chunk):
            out = self.step([(seq, prompt[start : start + chunk])])[0]
        return out
