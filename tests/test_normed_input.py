"""A layer's input norm handed to the layer uncomputed (ops.NormedInput): its first projection may take
the norm and the residual add into its GEMV (the "rmsnorm" fusion, ops.normed_linear); anything else
computes it once; the next residual exists once it has been computed."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from decode_row import decode_row_logits

import deltaserve.ops as ops
from deltaserve.config import ModelConfig
from deltaserve.ops.batch import BatchRow, build_forward_batch
from deltaserve.tiny import text_config

triton_linear = pytest.importorskip("deltaserve.ops.triton.linear")


def _inputs(rows: int = 1, residual: bool = True) -> ops.NormedInput:
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 64, generator=gen).bfloat16()
    res = torch.randn(rows, 64, generator=gen).bfloat16() if residual else None
    return ops.NormedInput(h, (0.2 * torch.randn(64, generator=gen)).bfloat16(), 1e-6, res)


def test_normed_computes_the_norm_and_the_next_residual_once():
    x = _inputs()
    want, want_sum = ops._norm_ref.rms_norm(x.hidden, x.weight, x.eps, x.residual)
    with pytest.raises(RuntimeError, match="never normalised, so the next residual is not computed"):
        x.next_residual  # noqa: B018
    assert torch.equal(x.normed(), want)
    assert torch.equal(x.next_residual, want_sum)
    with pytest.raises(RuntimeError, match="normalised once"):
        x.normed()


def test_without_a_residual_the_next_residual_is_the_hidden_state():
    x = _inputs(residual=False)
    assert x.next_residual is x.hidden
    assert torch.equal(x.normed(), ops._norm_ref.rms_norm(x.hidden, x.weight, x.eps))


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return ops._activation_ref.silu_and_mul(gate_up)


def _conv_columns(y: torch.Tensor, conv) -> torch.Tensor:
    """y with its first conv channels through the reference conv of decode rows at conv.slots."""
    if conv is None:
        return y
    rows = [BatchRow([1], context_len=1, pages=[0], state_slot=int(s)) for s in conv.slots]
    batch = build_forward_batch(rows, page_size=16, device=y.device)
    channels = conv.weight.shape[0]
    y = y.clone()
    y[:, :channels] = ops._conv1d_ref.causal_conv1d(y[:, :channels], conv.weight, conv.state, batch)
    return y


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """The "rmsnorm" fusion on, with the op boundary taking CPU tensors for a GPU's and the kernels
    standing in by their references: each fused call's (rows, with a residual)."""
    calls: list[tuple[int, bool]] = []

    def fused_reference(
        h, norm_weight, eps, weight, residual=None, swiglu_out=False, conv=None, prefetch=None
    ):
        calls.append((h.shape[0], residual is not None))
        if residual is None:
            normed, summed = ops._norm_ref.rms_norm(h, norm_weight, eps), None
        else:
            normed, summed = ops._norm_ref.rms_norm(h, norm_weight, eps, residual)
        y = F.linear(normed, weight)
        return (_swiglu(y) if swiglu_out else _conv_columns(y, conv)), summed

    def gemv_reference(x, w, prefetch=None, conv=None):
        if conv is not None:
            calls.append(("conv", x.shape[0]))
        return _conv_columns(F.linear(x, w), conv)

    monkeypatch.setattr(ops, "_streams_weights", lambda x, w: x.dim() == 2 and x.dtype == torch.bfloat16)
    monkeypatch.setattr(triton_linear, "gemv", gemv_reference)
    monkeypatch.setattr(triton_linear, "gemv_rms_norm", fused_reference)
    monkeypatch.setattr(
        triton_linear,
        "gemv_swiglu_out",
        lambda x, w, prefetch=None: calls.append(("act", x.shape[0])) or _swiglu(F.linear(x, w)),
    )
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"rmsnorm"}))
    return calls


def test_the_first_projection_of_a_gemv_row_takes_the_norm(fused):
    w = torch.randn(8, 64).bfloat16()
    one, two = _inputs(1), _inputs(2)
    want_one = F.linear(ops._norm_ref.rms_norm(one.hidden, one.weight, one.eps, one.residual)[0], w)
    assert torch.equal(ops.normed_linear(one, w), want_one)
    assert torch.equal(one.next_residual, one.hidden + one.residual)
    ops.normed_linear(two, w)  # two rows: the norm, then the linear
    ops.normed_linear(_inputs(1, residual=False), w)
    assert fused == [(1, True), (1, False)]
    with pytest.raises(RuntimeError, match="normalised once"):
        ops.normed_linear(one, w)


def test_rows_wider_than_the_fusions_bound_take_the_norm_then_the_linear(fused):
    """The "rmsnorm" fusion takes rows of up to RMS_NORM_FUSION_MAX_K values (the GEMV's registers grow
    with the row); a wider row (the 27B's 5,120) is normalised by the norm kernel, then projected."""
    gen = torch.Generator().manual_seed(0)
    for k in (ops.RMS_NORM_FUSION_MAX_K, ops.RMS_NORM_FUSION_MAX_K + 64):
        h, res = (torch.randn(1, k, generator=gen).bfloat16() for _ in range(2))
        x = ops.NormedInput(h, (0.2 * torch.randn(k, generator=gen)).bfloat16(), 1e-6, res)
        w = torch.randn(8, k, generator=gen).bfloat16()
        want = F.linear(ops._norm_ref.rms_norm(h, x.weight, 1e-6, res)[0], w)
        assert torch.equal(ops.normed_linear(x, w), want)
        assert torch.equal(x.next_residual, ops._norm_ref.rms_norm(h, x.weight, 1e-6, res)[1])
    assert fused == [(1, True)]  # the first width only


def test_the_fusion_off_computes_the_norm_then_the_linear(fused, monkeypatch):
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"norm"}))
    ops.normed_linear(_inputs(1), torch.randn(8, 64).bfloat16())
    assert fused == []


def test_a_plain_tensor_goes_to_the_linear(fused):
    x, w = torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert torch.equal(ops.normed_linear(x, w), F.linear(x, w))
    assert fused == []


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_a_decode_row_gets_the_same_logits_with_the_norms_in_its_first_projections(
    preset, fused, monkeypatch
):
    """Every layer's input norm, and a dense MLP's, goes into the projection after it at a decode row
    (an MoE block computes its own: the router, the experts and the shared expert all read it); the
    residual stream is the unfused forward's, so the logits are its bits."""
    fused_logits = decode_row_logits(preset)
    layers = ModelConfig.from_dict(text_config(preset)).num_hidden_layers
    norms_fused = fused.copy()
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset())
    assert torch.equal(fused_logits, decode_row_logits(preset))
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"rmsnorm", "swiglu_out"}))
    fused.clear()
    assert torch.equal(decode_row_logits(preset), fused_logits)  # the activation from gate_up's GEMV too
    shared_experts = [("act", 1)] * layers if preset == "tiny-moe" else []  # a shared expert: an MLP
    assert Counter(fused) == Counter(norms_fused + shared_experts)
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"conv"}))  # each GDN layer's conv in its in_proj
    fused.clear()
    assert torch.equal(decode_row_logits(preset), fused_logits)
    gdn_layers = len(ModelConfig.from_dict(text_config(preset)).layer_types) - len(
        ModelConfig.from_dict(text_config(preset)).full_attention_layers
    )
    assert fused == [("conv", 1)] * gdn_layers
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"conv", "rmsnorm"}))  # the in_proj over its norm too
    fused.clear()
    assert torch.equal(decode_row_logits(preset), fused_logits)
    assert fused == norms_fused
    first_layer = [(1, False)]  # the first input norm has no residual: the embedding is the residual
    if preset == "tiny":
        assert norms_fused == first_layer + [(1, True)] * (2 * layers - 1)
    else:
        assert norms_fused == first_layer + [(1, True)] * (layers - 1)


def test_a_dense_mlp_writes_its_activation_from_the_gate_up_gemv(fused, monkeypatch):
    gate_up, down = torch.randn(16, 64).bfloat16(), torch.randn(64, 8).bfloat16()
    x = torch.randn(1, 64).bfloat16()
    want = F.linear(_swiglu(F.linear(x, gate_up)), down)
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"swiglu_out"}))
    assert torch.equal(ops.swiglu_mlp(x, gate_up, down), want)
    pending = _inputs(1)
    ops.swiglu_mlp(pending, gate_up, down)  # without "rmsnorm": the norm, then the activation GEMV
    assert fused == [("act", 1), ("act", 1)]
    fused.clear()
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"swiglu_out", "rmsnorm"}))
    pending = _inputs(1)
    normed, summed = ops._norm_ref.rms_norm(pending.hidden, pending.weight, pending.eps, pending.residual)
    assert torch.equal(
        ops.swiglu_mlp(pending, gate_up, down), F.linear(_swiglu(F.linear(normed, gate_up)), down)
    )
    assert torch.equal(pending.next_residual, summed)
    ops.swiglu_mlp(torch.randn(2, 64).bfloat16(), gate_up, down)  # two rows: cuBLAS and the kernel
    assert fused == [(1, True)]


def test_the_conv_fusion_takes_batches_of_decode_rows_only():
    """ops.in_proj_conv fuses the conv only where every token is a decode row's (one token, context > 0)."""
    from deltaserve.ops.batch import decode_rows_only

    decodes = [BatchRow([1], context_len=4, pages=[1], state_slot=s) for s in (3, 0)]
    batch = build_forward_batch(decodes, page_size=16, device=torch.device("cpu"))
    assert decode_rows_only(batch, 2)
    assert not decode_rows_only(batch, 3)  # a token past the decode rows: a prompt chunk's
    chunk = BatchRow([1, 2], 0, pages=[2], state_slot=1)
    mixed = build_forward_batch([*decodes, chunk], page_size=16, device=torch.device("cpu"))
    assert not decode_rows_only(mixed, 4)
    prompt = build_forward_batch(
        [BatchRow([5], 0, pages=[2], state_slot=1)], page_size=16, device=torch.device("cpu")
    )
    assert not decode_rows_only(prompt, 1)  # a one-token prompt has no context: not a decode row
