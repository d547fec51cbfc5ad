"""The LM head's float32 logits are allocated at the caller's padded row count: a saturated server's
growing decode-row counts then reuse the caching allocator's blocks instead of allocating each step."""

from __future__ import annotations

import torch

from deltaserve.config import ModelConfig
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.tiny import official_config


def test_logits_of_the_first_rows_are_a_view_of_all_the_padded_rows():
    torch.manual_seed(0)
    config = ModelConfig.from_dict(official_config("tiny"))
    model = Qwen35ForCausalLM(config, dtype=torch.bfloat16, device=torch.device("cpu"))
    torch.nn.init.normal_(model.lm_head)
    hidden = torch.randn(8, model.config.hidden_size, dtype=torch.bfloat16)
    hidden[5:] = 0  # padding rows
    logits = model.compute_logits(hidden, rows=5)
    n = model.logits_vocab_size
    assert logits.shape == (5, n) and logits.dtype == torch.float32 and logits.is_contiguous()
    assert logits.untyped_storage().nbytes() == 8 * n * 4  # allocated at the padded count
    torch.testing.assert_close(logits, model.compute_logits(hidden)[:5], rtol=0, atol=0)  # same GEMM
    assert model.compute_logits(hidden).shape == (8, n)


def test_logits_written_into_a_buffer_are_the_same_bits_in_its_front_rows():
    """The decode graphs share one logits buffer (engine/cuda_graphs.py): each writes its bucket's rows
    into its front, and gets the same values it would get in a tensor of its own."""
    torch.manual_seed(0)
    config = ModelConfig.from_dict(official_config("tiny"))
    model = Qwen35ForCausalLM(config, dtype=torch.bfloat16, device=torch.device("cpu"))
    torch.nn.init.normal_(model.lm_head)
    n = model.logits_vocab_size
    buffer = torch.full((8, n), float("nan"))
    hidden = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16)
    logits = model.compute_logits(hidden, rows=3, out=buffer)
    assert logits.shape == (3, n) and logits.data_ptr() == buffer.data_ptr()  # a view of the front
    torch.testing.assert_close(logits, model.compute_logits(hidden, rows=3), rtol=0, atol=0)
    assert not buffer[:4].isnan().any() and buffer[4:].isnan().all()  # the 4 rows computed, no more
