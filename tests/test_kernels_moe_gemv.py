"""The per-slot expert GEMVs (ops/triton/moe_gemv.py) against the torch reference and the grouped
kernels, in Triton's CPU interpreter without CUDA and natively with it. Outputs and workspaces start as
NaN (test_kernels_moe's fixture), so a value the kernels fail to write cannot pass."""

from __future__ import annotations

import pytest
import torch
from test_kernels_moe import (
    DEVICE,
    DTYPES,
    E,
    H,
    assert_matches,
    make_inputs,
    nan_workspaces,  # noqa: F401  (an autouse fixture, active where imported)
    poisoned,
    reference_summed_in_fp32,
    replay_with_new_routing,
    run_without_host_reads,
)

import deltaserve.ops as ops
from deltaserve.ops import moe

gemv = pytest.importorskip("deltaserve.ops.triton.moe_gemv")


def run_slots(x, w13, w2, weights, ids) -> torch.Tensor:
    out = poisoned(*x.shape, dtype=x.dtype)
    got = gemv.slot_experts(x, w13, w2, weights, ids, out=out)
    assert got is out
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (1, 2), (3, 2), (4, 2), (37, 2)])
def test_matches_reference(dtype: torch.dtype, tokens: int, top_k: int) -> None:
    inputs = make_inputs(tokens, top_k, dtype, seed=100 * tokens + top_k)
    assert_matches(run_slots(*inputs), moe.fused_experts(*inputs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "top_k", "seed"), [(3, 4, 4), (4, 8, 8)])  # 4 x 8: the default bound
def test_more_than_two_experts_per_token_sum_in_fp32(dtype: torch.dtype, tokens: int, top_k: int, seed: int):
    inputs = make_inputs(tokens, top_k, dtype, seed=seed)
    got = run_slots(*inputs)
    assert_matches(got, reference_summed_in_fp32(*inputs))
    torch.testing.assert_close(got, moe.fused_experts(*inputs), rtol=2e-2, atol=2e-2)


def test_gives_the_grouped_kernels_result_in_bf16() -> None:
    """Both round at the same steps; only the dot products' summation order differs, which bf16 rounding
    hides almost everywhere."""
    tri = pytest.importorskip("deltaserve.ops.triton.moe")
    inputs = make_inputs(4, 8, torch.bfloat16, seed=8)
    got, grouped = run_slots(*inputs), tri.fused_experts(*inputs)
    torch.testing.assert_close(got, grouped, rtol=2e-2, atol=2e-2)
    assert (got == grouped).float().mean().item() >= 0.95


def test_every_token_on_one_expert() -> None:
    """Slots of different tokens on the same expert each stream it: nothing is shared between slots."""
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(5))
    logits[:, 3] += 20.0
    inputs = make_inputs(4, 2, torch.bfloat16, seed=5, logits=logits)
    assert (inputs[4][:, 0] == 3).all()
    assert_matches(run_slots(*inputs), moe.fused_experts(*inputs))


def test_a_strided_expert_stack_is_read_through_its_strides() -> None:
    """w13 and w2 as views of wider stacks (a tensor-parallel shard's slice of I is one)."""
    x, w13, w2, weights, ids = make_inputs(2, 2, torch.bfloat16, seed=9)
    wide13 = torch.zeros(E, w13.shape[1], H + 8, dtype=w13.dtype, device=DEVICE)
    wide13[:, :, 4 : 4 + H] = w13
    wide2 = torch.zeros(E, H, w2.shape[2] + 8, dtype=w2.dtype, device=DEVICE)
    wide2[:, :, :-8] = w2
    got = run_slots(x, wide13[:, :, 4 : 4 + H], wide2[:, :, :-8], weights, ids)
    assert_matches(got, moe.fused_experts(x, w13, w2, weights, ids))


def test_zero_tokens_returns_an_empty_result() -> None:
    x, w13, w2, weights, ids = make_inputs(1, 2, torch.bfloat16, seed=1)
    got = gemv.slot_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert got.shape == (0, H)


def test_bad_inputs_are_rejected_naming_the_argument() -> None:
    x, w13, w2, weights, ids = make_inputs(3, 2, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match=r"w2 has shape \(8, 48, 39\), expected \(8, 48, 40\)"):
        gemv.slot_experts(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16"):
        gemv.slot_experts(x, w13, w2, weights, ids, out=torch.zeros(3, H, device=DEVICE))


def test_no_tensor_value_is_read_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(3, 2, torch.bfloat16, seed=6)
    got = run_without_host_reads(monkeypatch, run_slots, inputs)
    assert_matches(got, moe.fused_experts(*inputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_replay_with_new_routing(dtype: torch.dtype) -> None:
    replay_with_new_routing(gemv.slot_experts, dtype, seed=11)


@pytest.mark.parametrize(
    ("setting", "slots", "kernel"), [(0, 8, "grouped"), (8, 8, "slots"), (8, 9, "grouped")]
)
def test_the_op_takes_the_slot_gemvs_up_to_the_setting(monkeypatch, setting: int, slots: int, kernel: str):
    """ops.fused_experts on a GPU tensor: the slot GEMVs for calls of up to MOE_SLOT_GEMV_SLOTS slots."""
    import deltaserve.ops.triton.moe as grouped

    calls: list[str] = []
    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(ops, "MOE_SLOT_GEMV_SLOTS", setting)
    monkeypatch.setattr(gemv, "slot_experts", lambda *a, **k: calls.append("slots"))
    monkeypatch.setattr(grouped, "fused_experts", lambda *a, **k: calls.append("grouped"))
    ids = torch.zeros(1, slots, dtype=torch.int64)
    ops.fused_experts(torch.zeros(1, H), torch.zeros(E, 2, H), torch.zeros(E, H, 1), ids.float(), ids)
    assert calls == [kernel]


@pytest.mark.parametrize(("text", "want"), [("0", 0), ("32", 32)])
def test_the_setting_parses(text: str, want: int) -> None:
    assert ops.parse_slot_gemv_slots(text) == want


@pytest.mark.parametrize("text", ["-1", "many", ""])
def test_a_bad_setting_names_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=f"DELTASERVE_MOE_SLOT_GEMV_SLOTS must be an integer >= 0.*{text!r}"):
        ops.parse_slot_gemv_slots(text)


def shared_inputs(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared expert's output [T, H] (a strided view) and its gate's weight [1, H]."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(tokens, H + 4, generator=gen).to(dtype).to(DEVICE)[:, 2 : 2 + H]
    gate = (torch.randn(1, H, generator=gen) / H**0.5).to(dtype).to(DEVICE)
    return shared, gate


def unfused_block(x, w13, w2, weights, ids, shared, gate) -> torch.Tensor:
    """The block's unfused ops, with the gate logit's dot in fp32 rounded once: what the kernel computes
    up to the fp32 sum's order (a one-column bf16 GEMM may round the logit elsewhere by an ulp, and one
    logit scales a whole row)."""
    logit = torch.nn.functional.linear(x.float(), gate.float()).to(x.dtype)
    return moe.fused_experts(x, w13, w2, weights, ids) + shared * torch.sigmoid(logit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (3, 2), (2, 4)])
def test_the_shared_expert_is_added_as_the_unfused_ops_add_it(dtype: torch.dtype, tokens: int, top_k: int):
    inputs = make_inputs(tokens, top_k, dtype, seed=7 * tokens + top_k)
    shared, gate = shared_inputs(tokens, dtype, seed=tokens)
    out = poisoned(tokens, H, dtype=dtype)
    got = gemv.slot_experts(*inputs, out=out, shared=gemv.SharedExpertOutput(shared, gate[0]))
    want = unfused_block(*inputs, shared, gate)
    if top_k > 2:  # the routed sum rounds once, the reference after each add
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    else:
        assert_matches(got, want)
    routed_only = run_slots(*inputs)
    assert not torch.equal(got, routed_only), "the shared expert's share was not added"


def test_a_shared_output_that_does_not_fit_is_named() -> None:
    inputs = make_inputs(3, 2, torch.bfloat16, seed=2)
    shared, gate = shared_inputs(3, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match=r"shared.out must be \(3, 48\) torch.bfloat16"):
        gemv.slot_experts(*inputs, shared=gemv.SharedExpertOutput(shared[:2], gate[0]))
    with pytest.raises(ValueError, match=r"shared.gate must be a contiguous \(48,\) torch.bfloat16 row"):
        gemv.slot_experts(*inputs, shared=gemv.SharedExpertOutput(shared, gate[0, :-1]))


@pytest.mark.parametrize(("setting", "kernel"), [(0, "unfused"), (2, "slots")])
def test_the_block_output_takes_one_kernel_at_decode_rows(monkeypatch, setting: int, kernel: str):
    """ops.moe_block_output: the slot kernels with the shared expert folded in up to the setting, the
    routed experts then the gate's ops otherwise; both give the unfused block's result."""
    inputs = make_inputs(1, 2, torch.bfloat16, seed=3)
    shared, gate = shared_inputs(1, torch.bfloat16, seed=3)
    calls: list[str] = []
    real = gemv.slot_experts

    def recording(*args, **kwargs):
        calls.append("slots" if kwargs.get("shared") is not None else "routed")
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(ops, "MOE_SLOT_GEMV_SLOTS", setting)
    monkeypatch.setattr(gemv, "slot_experts", recording)
    monkeypatch.setattr(ops, "fused_experts", lambda *a: calls.append("unfused") or moe.fused_experts(*a))
    exact = lambda x, w, then=None: torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)  # noqa: E731
    monkeypatch.setattr(ops, "linear", exact)
    got = ops.moe_block_output(*inputs, shared, gate)
    assert calls == [kernel]
    assert_matches(got, unfused_block(*inputs, shared, gate))
