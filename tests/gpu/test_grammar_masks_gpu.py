"""Structured output's mask kernel is warmed at start-up (engine/structured.py warm_grammar_masks):
afterwards a mask step queued behind a busy device neither compiles nor loads anything, so the host
does not wait for the device to drain."""

from __future__ import annotations

import time

import pytest
import torch

from deltaserve.engine.structured import (
    GrammarBackend,
    apply_grammars,
    grammar_vocabulary,
    grammars_available,
    warm_grammar_masks,
)
from deltaserve.sampling_params import StructuredOutputParams
from deltaserve.tiny import default_model_dir
from deltaserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not grammars_available(), reason="needs xgrammar")


def test_after_the_warm_up_a_masked_step_does_not_wait_for_a_busy_device():
    tokenizer = Tokenizer.from_dir(default_model_dir())
    backend = GrammarBackend(lambda: grammar_vocabulary(tokenizer), [248046, 248044])
    device = torch.device("cuda")
    width = backend.vocab_size
    warm_grammar_masks(backend, width, device)
    grammars = [backend.grammar(StructuredOutputParams(json_object=True)) for _ in range(3)]
    a = torch.randn(8192, 8192, device=device)
    logits = torch.zeros(5, width, device=device)
    torch.cuda.synchronize()
    for _ in range(40):  # ~hundreds of ms of queued work
        a = a @ a / 8192
    started = time.monotonic()
    apply_grammars(logits, [grammars[0], None, grammars[1], grammars[2], None])
    host_ms = (time.monotonic() - started) * 1e3
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy and host_ms < 50, f"{host_ms:.1f} ms on the host while the device was busy"
    masked = torch.isinf(logits).sum(dim=1).tolist()
    assert masked[1] == masked[4] == 0 and min(masked[0], masked[2], masked[3]) > 0  # JSON must open
