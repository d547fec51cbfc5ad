"""Start-up warm-up (GPU only): forwards at the shapes serving will use, before the KV pool is sized.

Every Triton kernel compiles and autotunes here, never on a user request, and the activation peak is
measured for the memory plan. The forwards write only the reserved page and slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.kv_pages import DUMMY_PAGE
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, build_forward_batch


def dummy_rows(num_seqs: int, tokens_each: int, page_size: int, *, context: int = 0) -> list[BatchRow]:
    """Rows that write only the reserved page and slot: for warm-up and graph capture."""
    pages = [DUMMY_PAGE] * -(-(context + tokens_each) // page_size)
    return [BatchRow([0] * tokens_each, context, pages, DUMMY_SLOT) for _ in range(num_seqs)]


@dataclass(slots=True)
class WarmupReport:
    peak_activation_bytes: int
    seconds: float


@torch.inference_mode()
def warm_up(
    model: Qwen35ForCausalLM, cache: DeviceCaches, max_batched_tokens: int, max_num_seqs: int
) -> WarmupReport:
    """Runs prefill and decode forwards at the shapes serving will use, on the reserved page and slot,
    and measures the activation peak above the resident weights and caches."""
    device = model.device
    torch.cuda.synchronize(device)
    started = time.monotonic()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    page = cache.page_size
    shapes = [(1, max_batched_tokens), (1, 64), (1, 17), (4, max(1, min(64, max_batched_tokens // 4)))]
    for seqs, tokens in shapes:
        batch = build_forward_batch(dummy_rows(seqs, tokens, page), page, device)
        model.compute_logits(model(batch, cache.kv, cache.states))
    for seqs in sorted({1, min(8, max_num_seqs), max_num_seqs}):
        batch = build_forward_batch(dummy_rows(seqs, 1, page, context=page + 1), page, device)
        model.compute_logits(model(batch, cache.kv, cache.states))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return WarmupReport(peak_activation_bytes=peak, seconds=time.monotonic() - started)
