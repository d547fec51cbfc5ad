"""The one-row GEMV kernel against F.linear (Triton's CPU interpreter without CUDA)."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.nn.functional as F

from deltaserve import ops
from deltaserve.ops.settings import DEFAULT_GEMV_FUSIONS

triton_linear = pytest.importorskip("deltaserve.ops.triton.linear")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Keep the autotuner on a GPU: the conv test checks that tuning, which runs a config more than once,
# leaves the conv state as one launch leaves it (restore_value).
AUTOTUNED = {"test_an_in_proj_gemv_with_the_conv_is_the_gemv_then_the_conv_decode"}


@pytest.fixture(autouse=True)
def one_block_shape_per_test(request, monkeypatch):
    """On a GPU each test runs one of the tuned block shapes, picked by its id, so the file as a whole
    runs them all, instead of timing every shape at each new problem (over 230 s for the file on an
    H100, most of it tuning). Without CUDA the interpreter runs its own blocks and this does nothing."""
    if DEVICE.type != "cuda" or request.node.originalname in AUTOTUNED:
        return
    pick = zlib.crc32(request.node.nodeid.encode())
    for tuned in (triton_linear._gemv_tuned, triton_linear._skinny_tuned):
        monkeypatch.setattr(tuned, "configs", [tuned.configs[pick % len(tuned.configs)]])


@pytest.mark.parametrize(
    ("n", "k", "m"), [(1, 64, 1), (37, 200, 1), (130, 1000, 1), (8, 64, 1), (37, 200, 3), (130, 1000, 4)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_linear_on_strided_rows_and_ragged_blocks(n, k, m, dtype):
    # N and K off the block multiples; x is m rows of a wider activation, W a row slice of a larger matrix.
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m + 2, k + 24, generator=gen).to(dtype).to(DEVICE)[1 : 1 + m, 8 : 8 + k]
    w = torch.randn(n + 5, k, generator=gen).to(dtype).to(DEVICE)[2 : 2 + n]
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # unwritten rows would stay NaN
    got = triton_linear.gemv(x, w, out=out)
    want = F.linear(x.double(), w.double())
    assert got.data_ptr() == out.data_ptr()
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of an fp32 sum: within a bf16 step of the exact result
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)


def test_gemv_rejects_mismatched_inputs_naming_them():
    x = torch.zeros(1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        triton_linear.gemv(torch.zeros(5, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="16 columns, the weight's K is 8"):
        triton_linear.gemv(x, torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        triton_linear.gemv(x, torch.zeros(4, 16, device=DEVICE, dtype=torch.bfloat16))


def test_op_boundary_sends_16bit_rows_to_the_gemv_and_when_switched_on_the_skinny_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(
        triton_linear, "gemv", lambda x, w, prefetch=None: calls.append(("gemv", *x.shape)) or F.linear(x, w)
    )
    monkeypatch.setattr(
        triton_linear, "skinny_gemm", lambda x, w: calls.append(("skinny", *x.shape)) or F.linear(x, w)
    )
    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    for m in (1, 4, 5, 16, 17):  # M > 16: cuBLAS
        ops.linear(torch.randn(m, 16, dtype=torch.bfloat16), w)
    ops.linear(torch.randn(1, 16), w.float())  # fp32: cuBLAS
    assert calls == [("gemv", 1, 16)]  # by default one row; the skinny GEMM is off: cuBLAS for 2..16 rows
    calls.clear()
    monkeypatch.setattr(ops, "GEMV_ROWS", 4)
    monkeypatch.setattr(ops, "SKINNY_GEMM", True)
    for m in (1, 4, 5, 16, 17):
        ops.linear(torch.randn(m, 16, dtype=torch.bfloat16), w)
    assert calls == [("gemv", 1, 16), ("gemv", 4, 16), ("skinny", 5, 16), ("skinny", 16, 16)]


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_gemm_matches_linear_on_strided_rows_and_ragged_blocks(m, dtype):
    n, k = 45, 100  # off the block multiples
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 24, generator=gen).to(dtype).to(DEVICE)[:, 8 : 8 + k]
    w = torch.randn(n + 5, k, generator=gen).to(dtype).to(DEVICE)[2 : 2 + n]
    got = triton_linear.skinny_gemm(x, w)
    want = F.linear(x.double(), w.double())
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)


def test_gemv_gives_a_row_the_same_bits_at_any_place_among_its_rows():
    """A verify row's positions: each token's bits are its own whatever its offset in the row."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(40, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
    full = triton_linear.gemv(x, w)
    assert torch.equal(triton_linear.gemv(x.flip(0), w), full.flip(0))
    assert torch.equal(triton_linear.gemv(x[[2, 0, 3, 1]], w), full[[2, 0, 3, 1]])


def test_skinny_gemm_gives_a_row_the_same_bits_whatever_the_other_rows():
    """What a replayed speculative recording and batch-invariant decode need."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(40, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
    full = triton_linear.skinny_gemm(x, w)
    assert torch.equal(triton_linear.skinny_gemm(x[3:7], w), full[3:7])
    assert torch.equal(triton_linear.skinny_gemm(x[5:7].flip(0), w), full[5:7].flip(0))


def test_skinny_gemm_rejects_more_rows_than_its_tile():
    with pytest.raises(ValueError, match=r"1..16 rows"):
        triton_linear.skinny_gemm(torch.zeros(17, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE))


@pytest.mark.parametrize(("n", "k", "m"), [(37, 200, 1), (130, 1000, 1), (45, 96, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_swiglu_has_the_bits_of_silu_and_mul_then_gemv(n, k, m, dtype):
    """The down projection with the SwiGLU computed inside the GEMV: in 16-bit dtypes the same bits as
    the two kernels (so fusing changes no token), and the torch reference's values. gate_up rows are
    strided and wider than 2K; N and K are off the block multiples. In fp32 nothing rounds the
    activation, so compiled code may contract or divide differently in the two kernels (a few ulps on
    CUDA): there the two agree to fp32 rounding."""
    from deltaserve.ops.triton.activation import silu_and_mul

    gen = torch.Generator().manual_seed(n + k + m)
    gate_up = torch.randn(m + 1, 2 * k + 16, generator=gen).mul(3).to(dtype).to(DEVICE)[1:, 8 : 8 + 2 * k]
    w = torch.randn(n + 5, k, generator=gen).to(dtype).to(DEVICE)[2 : 2 + n]
    got = triton_linear.gemv_swiglu(gate_up, w)
    assert got.shape == (m, n) and got.dtype == dtype
    unfused = triton_linear.gemv(silu_and_mul(gate_up), w)
    if dtype == torch.float32:
        torch.testing.assert_close(got, unfused, rtol=1e-6, atol=1e-5)
    else:
        assert torch.equal(got, unfused)
    act = ops._activation_ref.silu_and_mul(gate_up.cpu()).to(DEVICE)  # rounded to the dtype, as HF's is
    want = F.linear(act.double(), w.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of an fp32 sum: within a step of the dtype of the exact result
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)


def test_gemv_swiglu_refuses_a_gate_up_not_twice_the_weights_k():
    with pytest.raises(ValueError, match=r"gate_up must be \(M, 2K\) = \(M, 32\) for a weight of K = 16"):
        triton_linear.gemv_swiglu(torch.zeros(1, 30, device=DEVICE), torch.zeros(4, 16, device=DEVICE))


def test_op_boundary_fuses_the_swiglu_into_the_gemvs_rows_only(monkeypatch):
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset())
    calls = []
    monkeypatch.setattr(
        triton_linear,
        "gemv_swiglu",
        lambda g, w, prefetch=None: calls.append(("fused", *g.shape)) or F.linear(ops.silu_and_mul(g), w),
    )
    monkeypatch.setattr(
        triton_linear, "gemv", lambda x, w, prefetch=None: calls.append(("gemv", *x.shape)) or F.linear(x, w)
    )
    monkeypatch.setattr(ops, "use_kernels", lambda t: False)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    gate_up = torch.randn(3, 32, dtype=torch.bfloat16)
    want = F.linear(F.silu(gate_up[:, :16]) * gate_up[:, 16:], w)
    torch.testing.assert_close(ops.silu_and_mul_linear(gate_up, w), want)  # the reference path
    assert calls == []
    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(
        "deltaserve.ops.triton.activation.silu_and_mul", lambda g: ops._activation_ref.silu_and_mul(g)
    )
    ops.silu_and_mul_linear(torch.randn(1, 32, dtype=torch.bfloat16), w)
    assert calls == [("gemv", 1, 16)]  # no fusion: the activation kernel, then the GEMV
    calls.clear()
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"swiglu"}))
    for m in (1, 2):
        ops.silu_and_mul_linear(torch.randn(m, 32, dtype=torch.bfloat16), w)
    ops.silu_and_mul_linear(torch.randn(1, 32), w.float())  # fp32: the two ops, cuBLAS
    assert calls == [("fused", 1, 32)]  # one row fused; two rows: the activation kernel, then cuBLAS


@pytest.mark.parametrize(("heads", "head_dim", "n", "m"), [(3, 64, 37, 1), (5, 32, 130, 1), (2, 64, 45, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_sigmoid_gated_matches_gating_then_gemv(heads, head_dim, n, m, dtype):
    """o_proj(attn * sigmoid(gate)) in one kernel, the gate read where q_proj leaves it: the gate half of
    each head's [query | gate] row. The product is rounded to the dtype as torch's two ops round it."""
    gen = torch.Generator().manual_seed(heads * head_dim + n + m)
    k = heads * head_dim
    q_gate = torch.randn(m, heads, 2 * head_dim + 8, generator=gen).mul(3).to(dtype).to(DEVICE)
    gate = q_gate[..., head_dim + 8 :]  # strided rows and heads, unit columns
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n + 5, k, generator=gen).to(dtype).to(DEVICE)[2 : 2 + n]
    got = triton_linear.gemv_sigmoid_gated(x, gate, w)
    assert got.shape == (m, n) and got.dtype == dtype
    gated = x * torch.sigmoid(gate.reshape(m, k))  # the two torch ops the layer ran before
    if dtype == torch.bfloat16:  # the dtype the fused path serves: fusing changes no bit
        assert torch.equal(got, triton_linear.gemv(gated, w))  # (fp32 sigmoids differ by ulps across libms)
    want = F.linear(gated.double(), w.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of an fp32 sum
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)


def test_gemv_sigmoid_gated_refuses_a_gate_of_another_shape_naming_it():
    x = torch.zeros(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"gate must be \(M, H, D\) with M = 1, H \* D = 64"):
        triton_linear.gemv_sigmoid_gated(
            x, torch.zeros(1, 3, 16, device=DEVICE), torch.zeros(4, 64, device=DEVICE)
        )


def test_op_boundary_gates_inside_the_gemvs_rows_only(monkeypatch):
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset())
    calls = []
    monkeypatch.setattr(
        triton_linear,
        "gemv_sigmoid_gated",
        lambda x, g, w, prefetch=None: (
            calls.append(("fused", *x.shape)) or F.linear(x * torch.sigmoid(g.reshape(x.shape)), w)
        ),
    )
    monkeypatch.setattr(
        triton_linear, "gemv", lambda x, w, prefetch=None: calls.append(("gemv", *x.shape)) or F.linear(x, w)
    )
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    q_gate = torch.randn(2, 2, 32, dtype=torch.bfloat16)
    x, gate = torch.randn(2, 32, dtype=torch.bfloat16), q_gate[..., 16:]
    want = F.linear(x * torch.sigmoid(gate.reshape(2, 32)), w)
    assert torch.equal(ops.sigmoid_gated_linear(x, gate, w), want)  # the reference path
    assert calls == []
    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr("deltaserve.ops.triton.activation.sigmoid_gate", ops._activation_ref.sigmoid_gate)
    ops.sigmoid_gated_linear(x[:1], gate[:1], w)
    assert calls == [("gemv", 1, 32)]  # no fusion: the gate kernel, then the GEMV
    calls.clear()
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"gate"}))
    ops.sigmoid_gated_linear(x[:1], gate[:1], w)
    ops.sigmoid_gated_linear(x, gate, w)  # two rows: the gate kernel, then cuBLAS
    assert calls == [("fused", 1, 32)]


def test_attention_output_gate_reads_the_strided_gate_without_copying_it():
    """The gate is every other head_dim slice of q_proj's output: sigmoid reads it where it lies and
    writes the contiguous operand of the product (a copy of the gate first was 0.74 ms of an 8k-token
    4B forward). Same bits as gating a contiguous copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q_gate = torch.randn(7, 4, 2 * 16, dtype=torch.bfloat16)
    x, gate = torch.randn(7, 4 * 16, dtype=torch.bfloat16), q_gate[..., 16:]
    w = torch.randn(12, 64, dtype=torch.bfloat16)
    with Recorder() as recorder:
        got = ops.sigmoid_gated_linear(x, gate, w)
    assert not any(
        name.startswith(("aten.clone", "aten.copy_", "aten._unsafe_view")) for name in recorder.ops
    )
    assert torch.equal(got, F.linear(x * torch.sigmoid(gate.contiguous().reshape(7, 64)), w))


@pytest.mark.parametrize(("heads", "head_dim", "n", "m"), [(3, 32, 37, 1), (4, 64, 130, 1), (2, 16, 45, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_gated_norm_matches_the_gated_norm_then_gemv(heads, head_dim, n, m, dtype):
    """out_proj(gated_rms_norm(o, z)) in one kernel, z read where in_proj leaves it (strided rows and
    heads). Against the torch reference of the two ops, and the two kernels it replaces."""
    from deltaserve.ops import norm as norm_ref
    from deltaserve.ops.triton.norm import gated_rms_norm

    gen = torch.Generator().manual_seed(heads * head_dim + n + m)
    k = heads * head_dim
    o = torch.randn(m, heads, head_dim, generator=gen).mul(2).to(dtype).to(DEVICE)
    proj = torch.randn(m, heads * (head_dim + 8) + 5, generator=gen).mul(2).to(dtype).to(DEVICE)
    z = proj[:, 5:].view(m, heads, head_dim + 8)[..., 8:]  # strided rows and heads, unit columns
    norm_w = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE)
    w = torch.randn(n + 5, k, generator=gen).to(dtype).to(DEVICE)[2 : 2 + n]
    got = triton_linear.gemv_gated_norm(o, z, norm_w, 1e-6, w)
    assert got.shape == (m, n) and got.dtype == dtype
    normed = norm_ref.gated_rms_norm(o.cpu(), z.cpu(), norm_w.cpu(), 1e-6).to(DEVICE)
    want = F.linear(normed.reshape(m, k).double(), w.double())
    unfused = triton_linear.gemv(gated_rms_norm(o, z, norm_w, 1e-6).reshape(m, k), w)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got, unfused, rtol=1e-5, atol=1e-5)
    else:  # a variance 1 fp32 ulp apart may round a normed element the other way: a bf16 step at most
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2e-2)
        torch.testing.assert_close(got.float(), unfused.float(), rtol=2**-7, atol=2e-2)


def test_gemv_gated_norm_refuses_what_it_cannot_normalise_naming_it():
    x, w = torch.zeros(1, 2, 24, device=DEVICE), torch.zeros(4, 48, device=DEVICE)
    with pytest.raises(ValueError, match="head dim must be a power of two <= 256, got 24"):
        triton_linear.gemv_gated_norm(x, x, torch.zeros(24, device=DEVICE), 1e-6, w)
    x = torch.zeros(1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm_weight must be \(16,\)"):
        triton_linear.gemv_gated_norm(x, x, torch.zeros(8, device=DEVICE), 1e-6, w[:, :32])


def test_op_boundary_normalises_inside_the_gemvs_rows_only(monkeypatch):
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset())
    calls = []
    monkeypatch.setattr(
        triton_linear,
        "gemv_gated_norm",
        lambda x, z, nw, eps, w, prefetch=None: calls.append(("fused", *x.shape)) or None,
    )
    monkeypatch.setattr(
        triton_linear, "gemv", lambda x, w, prefetch=None: calls.append(("gemv", *x.shape)) or F.linear(x, w)
    )
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 4, 16, dtype=torch.bfloat16)
    z, nw = torch.randn(2, 4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    want = F.linear(ops._norm_ref.gated_rms_norm(x, z, nw, 1e-6).reshape(2, 64), w)
    assert torch.equal(ops.gated_norm_linear(x, z, nw, 1e-6, w), want)  # the reference path
    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr("deltaserve.ops.triton.norm.gated_rms_norm", ops._norm_ref.gated_rms_norm)
    ops.gated_norm_linear(x[:1], z[:1], nw, 1e-6, w)
    assert calls == [("gemv", 1, 64)]  # no fusion: the norm kernel, then the GEMV
    calls.clear()
    monkeypatch.setattr(ops, "FUSED_GEMV", frozenset({"norm"}))
    ops.gated_norm_linear(x[:1], z[:1], nw, 1e-6, w)
    ops.gated_norm_linear(x, z, nw, 1e-6, w)  # two rows: the norm kernel, then cuBLAS
    odd = torch.randn(1, 4, 12, dtype=torch.bfloat16)  # a head dim not a power of two: the two kernels
    ops.gated_norm_linear(
        odd, odd, torch.randn(12, dtype=torch.bfloat16), 1e-6, torch.randn(8, 48).bfloat16()
    )
    assert calls == [("fused", 1, 4, 16), ("gemv", 1, 48)]


def test_the_default_fusions_are_the_gated_three():
    """The three fusions the 4B GPU gate passed with and that measured faster at batch 1 are the default."""
    assert ops.parse_gemv_fusions(DEFAULT_GEMV_FUSIONS) == {"rmsnorm", "swiglu_out", "conv"}
    if "DELTASERVE_FUSED_GEMV" not in os.environ:
        assert {"rmsnorm", "swiglu_out", "conv"} == ops.FUSED_GEMV


def test_fused_gemv_variable_names_the_fusions_or_all_of_them():
    assert ops.parse_gemv_fusions("") == ops.parse_gemv_fusions("0") == frozenset()
    every = {"swiglu", "gate", "norm", "rmsnorm"}
    assert ops.parse_gemv_fusions("1") == ops.parse_gemv_fusions("all") == every | {"swiglu_out", "conv"}
    assert ops.parse_gemv_fusions(" gate, norm ") == {"gate", "norm"}
    with pytest.raises(
        ValueError,
        match=r"unknown fusion\(s\) 'silu'.*swiglu, gate, norm, rmsnorm, swiglu_out, conv, got 'gate,silu'",
    ):
        ops.parse_gemv_fusions("gate,silu")


@pytest.mark.parametrize("k", [40, 64, 200])  # under one K block, exactly one (the interpreter's 64), ragged
@pytest.mark.parametrize("mode", ["plain", "swiglu", "sigmoid gate", "gated norm"])
def test_gemv_preloading_its_first_block_gives_the_same_bits(mode, k, monkeypatch):
    """The first K block loaded before the PDL wait is accumulated first, as the loop would: every GEMV
    mode gives the same bits with the preload on and off, in one and in several rows."""
    gen = torch.Generator().manual_seed(k)
    n, m, head_dim = 37, 3, 8
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    g = torch.randn(m, k // head_dim, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm_w = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
    call = {
        "plain": lambda: triton_linear.gemv(x, w),
        "swiglu": lambda: triton_linear.gemv_swiglu(torch.cat([x, x.flip(1)], dim=1), w),
        "sigmoid gate": lambda: triton_linear.gemv_sigmoid_gated(x, g, w),
        "gated norm": lambda: triton_linear.gemv_gated_norm(x.view(m, -1, head_dim), g, norm_w, 1e-6, w),
    }[mode]
    monkeypatch.setattr(triton_linear, "PRELOAD", True)
    preloaded = call()
    monkeypatch.setattr(triton_linear, "PRELOAD", False)
    looped = call()
    assert torch.equal(preloaded, looped)
    if mode == "plain":
        torch.testing.assert_close(
            preloaded.double(), F.linear(x.double(), w.double()), rtol=2**-8, atol=1e-2
        )


@pytest.mark.parametrize(("text", "on"), [("1", True), ("0", False), (" 1 ", True)])
def test_the_preload_setting_reads_0_or_1(text, on):
    from deltaserve.ops.settings import parse_switch

    assert parse_switch("DELTASERVE_GEMV_PRELOAD", text) is on


@pytest.mark.parametrize("text", ["2", "yes", ""])
def test_a_bad_preload_setting_names_the_variable_and_the_value(text):
    from deltaserve.ops.settings import parse_switch

    with pytest.raises(ValueError, match=rf"DELTASERVE_GEMV_PRELOAD must be 0 or 1, got '{text}'"):
        parse_switch("DELTASERVE_GEMV_PRELOAD", text)


@pytest.mark.parametrize(("preload", "swiglu_out"), [(1, 0), (0, 0), (1, 1)])
def test_only_the_weights_first_block_loads_before_the_pdl_wait(preload, swiglu_out):
    """Compiled for sm_90: with the preload, the loads before griddepcontrol.wait are the first weight
    block's alone (8 x 256 values over 128 threads: 16 a thread, 32 with both halves of a [gate; up]
    weight; an x load would add 2) and nothing is stored before it; without it nothing loads before it."""
    from hopper_ptx import COMPILE_FOR_HOPPER, hopper_ptx

    code = hopper_ptx(COMPILE_FOR_HOPPER, "gemv", str(preload), str(swiglu_out))
    wait = next(i for i, line in enumerate(code) if line.startswith("griddepcontrol.wait"))
    before = [line for line in code[:wait] if "ld.global" in line or "st.global" in line]
    assert len(before) == 16 * preload * (1 + swiglu_out), before
    assert all("ld.global" in line for line in before)
    assert any("ld.global" in line for line in code[wait:])


@pytest.mark.parametrize("swiglu_out", ["0", "1"])
def test_the_gemv_compiles_where_an_integer_argument_is_1(swiglu_out):
    """Triton fixes an integer argument that is 1 at a launch as a constant (a Python int, no tensor
    methods), so a one-output GEMV or a unit stride compiles another kernel: compiled for sm_90 with each
    such argument fixed at 1. The interpreter passes them as tensors and cannot tell."""
    from hopper_ptx import COMPILE_FOR_HOPPER, hopper_ptx

    ones = "N,K,stride_xm,stride_wn,stride_om,stride_gm,stride_gh,stride_cw_k,stride_cs_k"
    code = hopper_ptx(COMPILE_FOR_HOPPER, "gemv", "1", swiglu_out, ones)
    assert any("st.global" in line for line in code)


def test_the_conv_windows_are_read_before_a_barrier_and_shifted_after_it():
    """Compiled for sm_90 with the conv epilogue (CONV_KW 4): a channel's values may sit in several
    threads, so every global load (the windows among them) comes before a CTA barrier that comes before
    the first global store (the shifted windows among them); without it a thread could read a window
    another thread has already shifted. The interpreter runs a block at once and cannot tell."""
    from hopper_ptx import COMPILE_FOR_HOPPER, hopper_ptx

    code = hopper_ptx(COMPILE_FOR_HOPPER, "gemv", "1", "0", "", "4")
    last_load = max(i for i, line in enumerate(code) if "ld.global" in line)
    first_store = min(i for i, line in enumerate(code) if "st.global" in line)
    assert any("bar.sync" in line for line in code[last_load:first_store]), (last_load, first_store)


@pytest.mark.parametrize(("n", "k", "m"), [(37, 200, 1), (130, 40, 1), (45, 64, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_rms_norm_matches_the_norm_then_gemv(n, k, m, dtype, with_residual):
    """A layer's first projection over its input norm in one kernel (h a strided view): the new residual
    has the rms_norm kernel's bits; the product is the two kernels' to a bf16 step (the sum of squares
    may add in another order), and the torch reference's."""
    from deltaserve.ops import norm as norm_ref
    from deltaserve.ops.triton.norm import rms_norm

    gen = torch.Generator().manual_seed(n + k + m)
    h = torch.randn(m + 1, k + 8, generator=gen).mul(3).to(dtype).to(DEVICE)[1:, 8:]
    residual = torch.randn(m, k, generator=gen).mul(3).to(dtype).to(DEVICE) if with_residual else None
    norm_w = (0.2 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    got, got_residual = triton_linear.gemv_rms_norm(h, norm_w, 1e-6, w, residual=residual)
    assert got.shape == (m, n) and got.dtype == dtype
    if with_residual:
        normed, want_residual = rms_norm(h, norm_w, 1e-6, residual)
        assert torch.equal(got_residual, want_residual)
        ref_normed, _ = norm_ref.rms_norm(h.cpu(), norm_w.cpu(), 1e-6, residual.cpu())
    else:
        normed = rms_norm(h, norm_w, 1e-6)
        assert got_residual is None
        ref_normed = norm_ref.rms_norm(h.cpu(), norm_w.cpu(), 1e-6)
    unfused = triton_linear.gemv(normed, w)
    want = F.linear(ref_normed.to(DEVICE).double(), w.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got, unfused, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got.float(), unfused.float(), rtol=2**-7, atol=5e-2)
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=5e-2)


def test_gemv_rms_norm_refuses_what_it_cannot_take_naming_it():
    h, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    norm_w = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"norm_weight must be \(64,\) of h's dtype torch.bfloat16, got \(32,\)"
    ):
        triton_linear.gemv_rms_norm(h, norm_w[:32], 1e-6, w)
    with pytest.raises(ValueError, match=r"residual must be \(1, 64\) torch.bfloat16 .* got \(2, 64\)"):
        triton_linear.gemv_rms_norm(h, norm_w, 1e-6, w, residual=torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual_out must not share memory with h or the residual"):
        residual = torch.zeros(1, 64, dtype=torch.bfloat16)
        triton_linear.gemv_rms_norm(h, norm_w, 1e-6, w, residual=residual, residual_out=residual)
    wide = torch.zeros(1, triton_linear.RMS_NORM_MAX_K + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"rows of at most 8192 values, got K = 8193"):
        triton_linear.gemv_rms_norm(wide, wide[0], 1e-6, torch.zeros(8, 8193, dtype=torch.bfloat16))


@pytest.mark.parametrize(("n", "k", "m"), [(37, 200, 1), (130, 40, 1), (45, 64, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_swiglu_out_has_the_bits_of_gemv_then_silu_and_mul(n, k, m, dtype):
    """A dense MLP's gate_up projection writing the activation (x a strided view): the GEMV's rounded
    gate and up halves, then the activation kernel's rounding, so the same bits as the two kernels."""
    from deltaserve.ops.triton.activation import silu_and_mul

    gen = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m + 1, k + 8, generator=gen).to(dtype).to(DEVICE)[1:, 8:]
    w = torch.randn(2 * n, k, generator=gen).to(dtype).to(DEVICE)
    got = triton_linear.gemv_swiglu_out(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul(triton_linear.gemv(x, w)))
    want = F.silu(F.linear(x.double(), w.double())[:, :n]) * F.linear(x.double(), w.double())[:, n:]
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-6, atol=5e-2)
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_rms_norm_can_write_the_swiglu_activation_too(with_residual):
    from deltaserve.ops.triton.activation import silu_and_mul

    gen = torch.Generator().manual_seed(3)
    h = torch.randn(1, 96, generator=gen).mul(3).bfloat16().to(DEVICE)
    residual = torch.randn(1, 96, generator=gen).bfloat16().to(DEVICE) if with_residual else None
    norm_w = (0.2 * torch.randn(96, generator=gen)).bfloat16().to(DEVICE)
    w = torch.randn(2 * 45, 96, generator=gen).bfloat16().to(DEVICE)
    act, summed = triton_linear.gemv_rms_norm(h, norm_w, 1e-6, w, residual=residual, swiglu_out=True)
    gate_up, want_sum = triton_linear.gemv_rms_norm(h, norm_w, 1e-6, w, residual=residual)
    assert torch.equal(act, silu_and_mul(gate_up))
    assert (summed is None) == (residual is None) and (summed is None or torch.equal(summed, want_sum))


def test_gemv_swiglu_out_refuses_an_odd_weight():
    with pytest.raises(ValueError, match="a \\[gate; up\\] weight has an even number of rows, got 7"):
        triton_linear.gemv_swiglu_out(torch.zeros(1, 64).bfloat16(), torch.zeros(7, 64).bfloat16())


@pytest.mark.parametrize(("rows", "with_norm"), [(1, False), (3, False), (1, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_in_proj_gemv_with_the_conv_is_the_gemv_then_the_conv_decode(rows, with_norm, dtype):
    """A Gated DeltaNet in_proj at decode rows with its causal conv in the GEMV: the first C outputs are
    the conv1d kernel's silu(conv) of the GEMV's outputs and each row's slot window shifts as that kernel
    shifts it (the same bits); the outputs past C are the GEMV's."""
    from deltaserve.ops.batch import BatchRow, build_forward_batch
    from deltaserve.ops.triton.conv1d import causal_conv1d

    gen = torch.Generator().manual_seed(rows)
    k, n, channels, width = 64, 45, 29, 4  # C off the block size: one program holds conv and plain outputs
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (0.2 * torch.randn(n, k, generator=gen)).to(dtype).to(DEVICE)
    conv_w = (0.5 * torch.randn(channels, width, generator=gen)).to(dtype).to(DEVICE)
    state = torch.randn(6, channels, width - 1, generator=gen).to(dtype).to(DEVICE)
    slots = [4, 1, 5][:rows]
    batch = build_forward_batch(
        [BatchRow([1], context_len=3, pages=[1], state_slot=s) for s in slots], page_size=16, device=DEVICE
    )
    conv = triton_linear.DecodeConv(conv_w, state.clone(), batch.state_slots)
    if with_norm:
        norm_w = (0.2 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
        got, _ = triton_linear.gemv_rms_norm(x, norm_w, 1e-6, w, conv=conv)
        plain, _ = triton_linear.gemv_rms_norm(x, norm_w, 1e-6, w)
    else:
        got = triton_linear.gemv(x, w, conv=conv)
        plain = triton_linear.gemv(x, w)
    want_state = state.clone()
    want_conv = causal_conv1d(plain[:, :channels].contiguous(), conv_w, want_state, batch)
    assert torch.equal(got[:, :channels], want_conv)
    assert torch.equal(got[:, channels:], plain[:, channels:])
    assert torch.equal(conv.state, want_state)


def test_a_conv_the_gemv_cannot_apply_is_named():
    w, x = torch.zeros(8, 64).bfloat16(), torch.zeros(1, 64).bfloat16()
    conv = triton_linear.DecodeConv(
        torch.zeros(12, 4).bfloat16(), torch.zeros(2, 12, 3).bfloat16(), torch.zeros(1)
    )
    with pytest.raises(ValueError, match=r"the conv needs weight \(C <= 8, KW >= 2\) .* got \(12, 4\)"):
        triton_linear.gemv(x, w, conv=conv)
    conv = triton_linear.DecodeConv(
        torch.zeros(6, 4).bfloat16(), torch.zeros(2, 6, 3).bfloat16(), torch.zeros(1)
    )
    with pytest.raises(ValueError, match=r"the conv needs 1 integer slots, got \(1,\) torch.float32"):
        triton_linear.gemv(x, w, conv=conv)
