"""After the start-up warm-up no eager step compiles a Triton kernel: decode rows beside prefill chunks
(launched apart and together, keys split and not), pure decode at short and long contexts, prefill
chunks at odd lengths. A kernel met first while serving compiles under load, a stall for every running
request (2.2 s at the 9B shape on an H100 before the warm-up took mixed steps)."""

from __future__ import annotations

import torch
import triton

from deltaserve.cache.device import build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.engine.warmup import dummy_rows, warm_up
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import load_weights
from deltaserve.ops.batch import build_forward_batch
from deltaserve.tiny import default_model_dir

DEVICE = torch.device("cuda")
PAGE, BUDGET, SEQS = 16, 8192, 256


def _step(decodes: int, context: int, chunks: list[int]):
    rows = dummy_rows(decodes, 1, PAGE, context=context)
    for tokens in chunks:
        rows += dummy_rows(1, tokens, PAGE)
    return build_forward_batch(rows, PAGE, DEVICE)


@torch.inference_mode()
def test_no_eager_step_compiles_a_kernel_after_the_warm_up(monkeypatch):
    model_dir = default_model_dir()
    model = Qwen35ForCausalLM(ModelConfig.from_dir(model_dir), dtype=torch.bfloat16, device=DEVICE)
    load_weights(model, model_dir)
    scratch = build_device_caches(
        model.local_config, num_pages=2, page_size=PAGE, num_slots=2, dtype=torch.bfloat16, device=DEVICE
    )
    warm_up(model, scratch, BUDGET, SEQS, sample=False)
    compiled: list[str] = []

    def record(*args, **kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", repr(kwargs.get("repr"))))
        return False  # compile as usual

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", record)
    steps = [
        (1, 1000, [BUDGET - 1]),  # together, split
        (72, 20, [3000, 2000, BUDGET - 5072]),  # together, not split
        (200, 1500, [5000, 333]),  # together
        (3, 900, [700, 333]),  # apart, split
        (5, 20, [100, 57]),  # apart, not split
        (0, 0, [1000, 2001, 77]),  # prefill only
        (1, 3000, []),  # decode only, split
        (37, 20, []),
        (SEQS, 700, []),
    ]
    for decodes, context, chunks in steps:
        model.compute_logits(model(_step(decodes, context, chunks), scratch.kv, scratch.states))
    torch.cuda.synchronize()
    assert compiled == [], f"compiled while serving: {sorted(set(compiled))}"
