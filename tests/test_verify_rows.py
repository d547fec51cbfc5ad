"""Verify rows (speculative decoding): a row of T tokens with context that keeps the GDN state after every
token. The torch reference ops and the whole model on a verify row must equal running its tokens one at
a time as decode rows: the same outputs (logits at every position), the state after token t in slot
state_after[t], the final state in the row's own slot; the batch's other rows are unaffected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from deltaserve.cache.device import build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import init_dummy_weights
from deltaserve.ops import causal_conv1d, gated_delta_rule
from deltaserve.ops.batch import BatchRow, ForwardBatch, build_forward_batch, logits_rows
from deltaserve.tiny import official_config

CPU = torch.device("cpu")
PAGE = 16
C, K = 24, 4  # conv channels and width
HK, HV, D = 2, 4, 8  # GDN key heads, value heads, head dim
SLOTS = 24
TOL = dict(rtol=1e-5, atol=1e-5)


def pages_for(tokens: int) -> list[int]:
    return list(range(1, 1 + -(-tokens // PAGE)))


def row(n: int, ctx: int, slot: int, state_after: tuple[int, ...] = ()) -> BatchRow:
    return BatchRow([7] * n, ctx, pages_for(ctx + n), slot, state_after=state_after)


@dataclass(slots=True)
class Inputs:
    """One GDN layer's op inputs, one row per token of a batch."""

    x: torch.Tensor  # [T, C] conv input
    q: torch.Tensor  # [T, HK, D]
    k: torch.Tensor
    v: torch.Tensor  # [T, HV, D]
    a: torch.Tensor  # [T, HV]
    b: torch.Tensor
    weight: torch.Tensor  # [C, K]
    A_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor

    def tokens(self, start: int, end: int) -> Inputs:
        per_token = ("x", "q", "k", "v", "a", "b")
        return dataclasses.replace(self, **{f: getattr(self, f)[start:end] for f in per_token})


def make_inputs(tokens: int, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    return Inputs(
        x=r(tokens, C),
        q=r(tokens, HK, D),
        k=r(tokens, HK, D),
        v=r(tokens, HV, D),
        a=r(tokens, HV),
        b=r(tokens, HV),
        weight=r(C, K, scale=0.5),
        A_log=torch.rand(HV, generator=gen) * 2,
        dt_bias=r(HV, scale=0.5) + 1,
    )


@dataclass(slots=True)
class States:
    conv: torch.Tensor  # [SLOTS, C, K-1]
    ssm: torch.Tensor  # [SLOTS, HV, D, D]

    def clone(self) -> States:
        return States(self.conv.clone(), self.ssm.clone())

    def slot(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[i].clone(), self.ssm[i].clone()


def make_states(seed: int, stale: set[int]) -> States:
    """Random states; the `stale` slots (never to be read) hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    states = States(torch.randn(SLOTS, C, K - 1, generator=gen), torch.randn(SLOTS, HV, D, D, generator=gen))
    states.conv[sorted(stale)] = float("nan")
    states.ssm[sorted(stale)] = float("nan")
    return states


def run_ops(batch: ForwardBatch, inputs: Inputs, states: States) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv and the gated delta rule of one GDN layer (each on its own inputs); states in place."""
    conv_out = causal_conv1d(inputs.x, inputs.weight, states.conv, batch)
    gdn_out = gated_delta_rule(
        inputs.q, inputs.k, inputs.v, inputs.a, inputs.b, inputs.A_log, inputs.dt_bias, states.ssm, batch
    )
    return conv_out, gdn_out


def assert_slot(states: States, slot: int, want: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    conv, ssm = want
    assert torch.equal(states.conv[slot], conv), f"{what}: conv window of slot {slot}"
    torch.testing.assert_close(states.ssm[slot], ssm, **TOL, msg=f"{what}: SSM state of slot {slot}")


def check_against_one_at_a_time(rows: list[BatchRow], seed: int) -> None:
    """One batch of `rows` against each row run alone, a verify row's tokens one decode step at a time."""
    batch = build_forward_batch(rows, PAGE, CPU)
    inputs = make_inputs(batch.num_tokens, seed)
    written = {s for r in rows for s in r.state_after}
    stale = written | {r.state_slot for r in rows if r.context_len == 0}
    start_states = make_states(seed, stale)
    got_states = start_states.clone()
    got_conv, got_gdn = run_ops(batch, inputs, got_states)

    want_states = start_states.clone()
    start = 0
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        if r.state_after:
            for t in range(n):
                step = build_forward_batch([row(1, r.context_len + t, r.state_slot)], PAGE, CPU)
                conv, gdn = run_ops(step, inputs.tokens(start + t, start + t + 1), want_states)
                what = f"row {i} token {t}"
                torch.testing.assert_close(got_conv[start + t], conv[0], **TOL, msg=what)
                torch.testing.assert_close(got_gdn[start + t], gdn[0], **TOL, msg=what)
                target = r.state_after[t] if t < n - 1 else r.state_slot
                assert_slot(got_states, target, want_states.slot(r.state_slot), f"state after {what}")
        else:
            conv, gdn = run_ops(
                build_forward_batch([r], PAGE, CPU), inputs.tokens(start, start + n), want_states
            )
            torch.testing.assert_close(got_conv[start : start + n], conv, **TOL, msg=f"row {i}")
            torch.testing.assert_close(got_gdn[start : start + n], gdn, **TOL, msg=f"row {i}")
            assert_slot(got_states, r.state_slot, want_states.slot(r.state_slot), f"row {i} final state")
        start += n
    untouched = sorted(set(range(SLOTS)) - written - {r.state_slot for r in rows})
    assert torch.equal(got_states.conv[untouched], start_states.conv[untouched])
    assert torch.equal(got_states.ssm[untouched], start_states.ssm[untouched])


# ---- the reference ops ------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill_context", [0, 3])
def test_verify_row_between_a_decode_row_and_a_prefill_chunk_equals_four_decode_steps(prefill_context):
    rows = [
        row(1, 5, 1),  # a decode row
        row(4, 7, 2, state_after=(9, 10, 11)),  # the verify row: T = 4
        row(6, prefill_context, 3),  # a prefill chunk, fresh (stale slot) or continuing
    ]
    check_against_one_at_a_time(rows, seed=prefill_context)


def test_verify_rows_of_different_lengths_in_one_batch():
    rows = [
        row(1, 3, 4),
        row(1, 20, 5),
        row(2, 9, 1, state_after=(12,)),
        row(5, 2, 6, state_after=(13, 14, 15, 16)),
        row(3, 40, 7, state_after=(17, 18)),
        row(4, 1, 2, state_after=(19, 20, 21)),
        row(9, 0, 8),
        row(1, 4, 3),  # one token with context after the verify rows: run as a prefill chunk
    ]
    check_against_one_at_a_time(rows, seed=11)


def test_verify_only_batch():
    check_against_one_at_a_time([row(3, 4, 1, state_after=(2, 3)), row(2, 17, 5, state_after=(6,))], seed=3)


# ---- build_forward_batch ----------------------------------------------------------------------------


def test_batch_lists_every_verify_token_for_logits_and_its_state_slots_in_row_order():
    rows = [
        row(1, 5, 1),
        row(1, 8, 2),
        row(3, 4, 3, state_after=(10, 11)),
        row(2, 16, 4, state_after=(12,)),
        dataclasses.replace(row(5, 0, 5), need_logits=False),  # a prompt chunk that samples nothing
        dataclasses.replace(row(4, 2, 6), scored=2),
    ]
    batch = build_forward_batch(rows, PAGE, CPU)
    assert (batch.num_decodes, batch.num_verify, batch.num_seqs) == (2, 2, 6)
    assert batch.query_start_loc.tolist() == [0, 1, 2, 5, 7, 12, 16]
    # decode tokens 0 and 1; verify tokens 2-4 and 5-6; the scoring chunk's last token 15; then the
    # scored tokens 12 and 13.
    assert batch.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 15, 12, 13]
    assert batch.verify_state_slots.tolist() == [10, 11, 3, 12, 4]
    assert batch.verify_state_slots.dtype == torch.int64
    assert batch.positions.tolist()[2:7] == [4, 5, 6, 16, 17]
    assert [logits_rows(r) for r in rows] == [1, 1, 3, 2, 0, 1]


def test_batch_without_verify_rows_is_unchanged():
    batch = build_forward_batch([row(1, 5, 1), row(3, 0, 2), row(1, 4, 3)], PAGE, CPU)
    assert (batch.num_decodes, batch.num_verify, batch.verify_state_slots) == (1, 0, None)
    assert batch.logits_indices.tolist() == [0, 3, 4]


def test_verify_row_after_a_prefill_chunk_is_refused():
    with pytest.raises(ValueError, match="verify row 2 follows a prefill chunk; order a batch's rows as"):
        build_forward_batch([row(1, 5, 1), row(3, 0, 2), row(2, 4, 3, state_after=(9,))], PAGE, CPU)
    # A one-token row after a verify row is a prefill chunk, so a verify row may not follow it either.
    with pytest.raises(ValueError, match="verify row 2 follows a prefill chunk"):
        rows = [row(2, 4, 3, state_after=(9,)), row(1, 5, 1), row(2, 4, 4, state_after=(10,))]
        build_forward_batch(rows, PAGE, CPU)


@pytest.mark.parametrize(
    ("bad", "found"),
    [
        (row(3, 4, 1, state_after=(9,)), "has context 4, 3 tokens, 1 state_after slots and need_logits=True"),
        (row(2, 4, 1, state_after=(9, 10)), "has context 4, 2 tokens, 2 state_after slots"),
        (row(1, 4, 1, state_after=(9,)), "has context 4, 1 tokens, 1 state_after slots"),
        (row(2, 0, 1, state_after=(9,)), "has context 0, 2 tokens, 1 state_after slots"),
        (
            dataclasses.replace(row(2, 4, 1, state_after=(9,)), need_logits=False),
            "has context 4, 2 tokens, 1 state_after slots and need_logits=False",
        ),
    ],
)
def test_malformed_verify_row_is_refused_naming_what_it_needs(bad, found):
    with pytest.raises(ValueError, match=f"verify row 1 {found}.*a verify row needs context > 0"):
        build_forward_batch([row(1, 5, 2), bad], PAGE, CPU)


# ---- the whole model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> Qwen35ForCausalLM:
    cfg = dataclasses.replace(ModelConfig.from_dict(official_config("tiny")), vocab_size=512)
    model = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=CPU)
    init_dummy_weights(model, seed=3)
    return model


def model_forward(model: Qwen35ForCausalLM, caches, rows: list[BatchRow]) -> torch.Tensor:
    batch = build_forward_batch(rows, caches.page_size, CPU)
    with torch.inference_mode():
        return model.compute_logits(model(batch, caches.kv, caches.states))


def test_model_verify_row_gives_the_logits_and_states_of_four_decode_steps(tiny_model):
    """Sequence A decodes one token per step; B verifies 4 tokens in one row; C's prompt chunk runs in
    the same forward. Against: the same tokens as 4 single-token steps of B (A and C alone)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 13, 11)]
    drafts = torch.randint(0, 512, (4,), generator=gen).tolist()
    caches = build_device_caches(
        tiny_model.local_config, num_pages=32, page_size=4, num_slots=10, dtype=torch.float32, device=CPU
    )
    pages = {0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10], 2: [11, 12, 13, 14, 15]}
    slots = {0: 1, 1: 2, 2: 3}
    after = (7, 8, 9)  # B's state_after slots
    model_forward(tiny_model, caches, [BatchRow(p, 0, pages[i], slots[i]) for i, p in enumerate(prompts[:2])])
    start = (caches.kv.k.clone(), caches.kv.v.clone(), caches.states.conv.clone(), caches.states.ssm.clone())

    a_row = BatchRow([prompts[0][0]], 9, pages[0], slots[0])
    b_row = BatchRow(drafts, 13, pages[1], slots[1], state_after=after)
    c_row = BatchRow(prompts[2][:6], 0, pages[2], slots[2])
    got = model_forward(tiny_model, caches, [a_row, b_row, c_row])
    assert got.shape[0] == logits_rows(a_row) + logits_rows(b_row) + logits_rows(c_row) == 6
    got_states = (caches.states.conv.clone(), caches.states.ssm.clone())

    for dst, src in zip(
        (caches.kv.k, caches.kv.v, caches.states.conv, caches.states.ssm), start, strict=True
    ):
        dst.copy_(src)
    want_a = model_forward(tiny_model, caches, [a_row])
    want_c = model_forward(tiny_model, caches, [c_row])
    torch.testing.assert_close(got[0], want_a[0], **TOL)
    torch.testing.assert_close(got[5], want_c[0], **TOL)
    for t, token in enumerate(drafts):
        want = model_forward(tiny_model, caches, [BatchRow([token], 13 + t, pages[1], slots[1])])
        torch.testing.assert_close(got[1 + t], want[0], **TOL, msg=f"logits of verify token {t}")
        target = after[t] if t < 3 else slots[1]
        # Every GDN layer's state; not bit-exact: a GEMM over 11 rows and one over 1 row may round apart.
        torch.testing.assert_close(got_states[0][:, target], caches.states.conv[:, slots[1]], **TOL)
        torch.testing.assert_close(got_states[1][:, target], caches.states.ssm[:, slots[1]], **TOL)
    for slot in (slots[0], slots[2]):
        torch.testing.assert_close(got_states[0][:, slot], caches.states.conv[:, slot], **TOL)
        torch.testing.assert_close(got_states[1][:, slot], caches.states.ssm[:, slot], **TOL)
