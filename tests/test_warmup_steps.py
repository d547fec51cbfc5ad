"""The start-up warm-up's eager steps with decode rows beside prefill chunks (engine/warmup.py): by hand,
and against the attention kernel's own choice of launch, so that every launch an eager step can make is
compiled before serving."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine import warmup
from deltaserve.engine.warmup import MixedStep, gated_norm_tokens, mixed_rows, mixed_steps
from deltaserve.ops.batch import build_forward_batch
from deltaserve.ops.triton import attention
from deltaserve.ops.triton.norm import _gated_launch_shape

PAGE = 16


def test_the_mixed_steps_by_hand():
    # 128-token chunks (half a 256-token split); contexts 17 (no split) and 512 (split)
    short = [MixedStep(17, (128,)), MixedStep(512, (128,))]
    assert mixed_steps(2048, PAGE, apart_tokens=4096, split_tokens=256) == short
    longer = [MixedStep(17, (128,) * 32), MixedStep(512, (128,) * 32)]
    assert mixed_steps(8192, PAGE, apart_tokens=4096, split_tokens=256) == short + longer
    assert mixed_steps(4097, PAGE, apart_tokens=4096, split_tokens=256) == short + longer
    assert mixed_steps(4096, PAGE, apart_tokens=4096, split_tokens=256) == short
    # the remainder as a last chunk; a budget below one chunk takes what it can
    assert mixed_steps(8192, PAGE, apart_tokens=300, split_tokens=256)[2:] == [
        MixedStep(17, (128, 128, 44)),
        MixedStep(512, (128, 128, 44)),
    ]
    assert mixed_steps(40, PAGE, apart_tokens=4096, split_tokens=256) == [
        MixedStep(17, (39,)),
        MixedStep(512, (39,)),
    ]
    assert mixed_steps(1, PAGE, apart_tokens=4096, split_tokens=256) == []  # no room beside the decode row


def test_mixed_rows_put_the_decode_row_first_on_the_reserved_page_and_slot():
    batch = build_forward_batch(mixed_rows(MixedStep(512, (128, 44)), PAGE), PAGE, torch.device("cpu"))
    assert batch.num_decodes == 1
    assert batch.query_lens_host == (1, 128, 44)
    assert batch.context_lens_host == (512, 0, 0)
    assert batch.block_tables.shape[1] == 33  # 513 tokens of the decode row
    assert int(batch.block_tables.max()) == warmup.DUMMY_PAGE
    assert set(batch.state_slots.tolist()) == {warmup.DUMMY_SLOT}


def _launch(step: MixedStep, num_kv_heads: int) -> tuple[bool, bool]:
    """(decode rows launched with the chunks, decode keys split) for the step, as paged_attention
    decides them."""
    batch = build_forward_batch(mixed_rows(step, PAGE), PAGE, torch.device("cpu"))
    tokens = sum(batch.query_lens_host)
    max_context = batch.block_tables.shape[1] * PAGE
    splits = attention.decode_num_splits(batch.num_decodes, num_kv_heads, max_context, torch.device("cpu"))
    return tokens > attention.DECODE_APART_MAX_TOKENS, splits > 1


@pytest.mark.parametrize("sms", [78, 132])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_the_mixed_steps_take_every_launch_an_eager_step_can(monkeypatch, sms, num_kv_heads):
    monkeypatch.setattr(attention, "sm_count", lambda device: sms)
    args = (PAGE, attention.DECODE_APART_MAX_TOKENS, attention.MIN_SPLIT_TOKENS)
    every = {(together, split) for together in (False, True) for split in (False, True)}
    assert {_launch(step, num_kv_heads) for step in mixed_steps(8192, *args)} == every
    # a budget no longer than the bound: the decode rows are always launched apart
    apart = {(False, False), (False, True)}
    budget = attention.DECODE_APART_MAX_TOKENS
    assert {_launch(step, num_kv_heads) for step in mixed_steps(budget, *args)} == apart


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("heads", [1, 3, 8, 16, 32, 48])
def test_the_warm_up_meets_every_program_shape_of_the_gated_norm(heads: int, head_dim: int) -> None:
    reachable = {_gated_launch_shape(head_dim, rows, None) for rows in range(1, 70_000, 7)}
    warmed = {
        _gated_launch_shape(head_dim, tokens * heads, None) for tokens in gated_norm_tokens(heads, head_dim)
    }
    assert warmed == reachable
    # By hand at the 4B shape (32 heads of 128): 1, 2, 4 and 8 heads per program.
    if (heads, head_dim) == (32, 128):
        assert gated_norm_tokens(heads, head_dim) == [32, 64, 128, 256]
