"""Is a position's forward the same whatever its offset inside a verify row?

Speculative decoding's benchmark replays a recording of the speculative path itself, which reproduces
only if every op gives a token the same bits whether it is the first token of its verify row or a
later one. Same prompt in two slots; slot A verifies [t0, t1, t2, t3] at context c; slot B verifies
[t0, x, x, x] (only t0 kept: the state after it committed), then [t1, t2, t3, t4] at context c + 1.
Positions c + 1 .. c + 3 are then computed at offsets 1..3 in A and 0..2 in B. Every mixer and MLP
output and the final hidden state are compared bit for bit.
"""

from __future__ import annotations

import torch

from deltaserve.cache.copies import StateCommit
from deltaserve.cache.device import DeviceCaches
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, build_forward_batch


def first_differences(model: Qwen35ForCausalLM, caches: DeviceCaches, prompt: list[int]) -> list[str]:
    """Names of the ops whose outputs for the shared positions differ (empty: bit-identical); the
    caches need 24 pages of 16 tokens and 12 state slots."""
    device, page = model.device, caches.page_size
    pages_a, pages_b = list(range(1, 13)), list(range(13, 25))
    slot_a, slot_b, scratch = 1, 2, [3, 4, 5]
    c = len(prompt)
    outputs: dict[str, list[torch.Tensor]] = {}

    def hook(name: str):
        def record(_module, _inputs, out):
            outputs.setdefault(name, []).append(out.detach().clone())

        return record

    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.mixer.register_forward_hook(hook(f"layers.{i}.mixer")))
        handles.append(layer.mlp.register_forward_hook(hook(f"layers.{i}.mlp")))

    def forward(rows: list[BatchRow]) -> torch.Tensor:
        batch = build_forward_batch(rows, page, device)
        return model(batch, caches.kv, caches.states, every_token=True)

    try:
        with torch.inference_mode():
            for slot, pages in ((slot_a, pages_a), (slot_b, pages_b)):
                forward([BatchRow(prompt, 0, pages, slot)])
            outputs.clear()
            t = [prompt[-1] + 1 + i for i in range(5)]
            hidden_a = forward([BatchRow(t[:4], c, pages_a, slot_a, state_after=scratch)])
            a = {name: outs[0] for name, outs in outputs.items()}
            outputs.clear()
            forward([BatchRow([t[0], 7, 7, 7], c, pages_b, slot_b, state_after=scratch)])
            caches.copy([StateCommit(scratch[0], slot_b)])
            outputs.clear()
            hidden_b = forward([BatchRow(t[1:5], c + 1, pages_b, slot_b, state_after=scratch)])
            b = {name: outs[0] for name, outs in outputs.items()}
    finally:
        for h in handles:
            h.remove()
    differing = [name for name in a if not torch.equal(a[name][1:4], b[name][0:3])]
    if not torch.equal(hidden_a[1:4], hidden_b[0:3]):
        differing.append("final hidden")
    return differing
