"""The TMA-streamed decode GEMV (ops/triton/gemv_tma.py) against torch's linear and against the pointer GEMV
of ops/triton/linear.py, whose bits it must give at the same block shape. Without CUDA the kernels run in
Triton's interpreter (tensor descriptors included)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hopper_ptx import compiled_output

gemv_tma = pytest.importorskip("deltaserve.ops.triton.gemv_tma")
triton_linear = pytest.importorskip("deltaserve.ops.triton.linear")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _operands(n: int, k: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: m rows of a wider activation; the weight: a row slice of a larger matrix (row stride K)."""
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m + 2, k + 24, generator=gen).to(dtype).to(DEVICE)[1 : 1 + m, 8 : 8 + k]
    w = torch.randn(n + 5, k, generator=gen).to(dtype).to(DEVICE)[2 : 2 + n]
    return x, w


@pytest.mark.parametrize(
    ("n", "k", "m"), [(37, 200, 1), (130, 1000, 1), (8, 64, 1), (37, 200, 3), (130, 1000, 4)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_tma_matches_linear_on_strided_rows_and_ragged_tiles(n, k, m, dtype):
    """N and K off the tile multiples: the descriptor's zero padding stands in for the pointer GEMV's
    masks; one rounding of an fp32 sum, within a 16-bit step of the exact result."""
    x, w = _operands(n, k, m, dtype)
    got = gemv_tma.gemv_tma(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double()), rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_tma_gives_the_pointer_gemvs_bits_at_the_same_block_shape(m, monkeypatch):
    """The same fp32 accumulator [BLOCK_N, BLOCK_K], summed in the same order: the same bits. On a GPU
    both run BLOCK_N 8, BLOCK_K 256; in the interpreter both run its (8, 64)."""
    x, w = _operands(130, 1000, m, torch.bfloat16)
    blocks = gemv_tma.TmaBlocks(8, 256, 4, 4) if DEVICE.type == "cuda" else gemv_tma.INTERPRETER_BLOCKS
    if DEVICE.type == "cuda":
        tuned = triton_linear._gemv_tuned
        same = [c for c in tuned.configs if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) == (8, 256)]
        monkeypatch.setattr(tuned, "configs", same)
    monkeypatch.setattr(triton_linear, "PRELOAD", 0)  # the preload sums the same first block first anyway
    assert torch.equal(gemv_tma.gemv_tma(x, w, blocks=blocks), triton_linear.gemv(x, w))


def test_gemv_tma_refuses_what_a_descriptor_cannot_take_naming_it():
    x, w = _operands(16, 64, 1, torch.bfloat16)
    with pytest.raises(ValueError, match=r"1 <= M <= 4, got \(5, 64\)"):
        gemv_tma.gemv_tma(torch.zeros(5, 64, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"K = 64 \(x's columns\), got \(16, 32\)"):
        gemv_tma.gemv_tma(x, w[:, :32])
    with pytest.raises(ValueError, match="16-bit dtype, got torch.float32 and torch.float32"):
        gemv_tma.gemv_tma(x.float(), w.float())
    with pytest.raises(ValueError, match="16-byte aligned, got base % 16 = 2"):
        gemv_tma.gemv_tma(x[:, :63], torch.zeros(16, 64, dtype=torch.bfloat16, device=DEVICE)[:, 1:])


# Compiles the kernel for sm_90 with Triton's own compiler (a process of its own: this one may interpret)
# and prints, per CONFIGS entry, its shared-memory tile buffers and its bulk tensor copies.
COMPILE_FOR_HOPPER = """
import json, re

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from deltaserve.ops.triton.gemv_tma import CONFIGS, _gemv_tma_kernel

report = []
for c in CONFIGS:
    constexprs = {"ROWS": 1, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "STAGES": c.stages, "USE_GDC": True}
    signature = {"w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>", "x_ptr": "*bf16", "out_ptr": "*bf16"}
    signature |= {"N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"}
    signature |= {name: "constexpr" for name in constexprs}
    source = ASTSource(fn=_gemv_tma_kernel, signature=signature, constexprs=constexprs)
    kernel = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": c.warps, "num_stages": c.stages})
    buffers = re.findall(r"memdesc<(\\d+)x" + str(c.block_n) + "x" + str(c.block_k) + "x", kernel.asm["ttgir"])
    ptx = kernel.asm["ptx"]
    first_read = min(ptx.find(op) for op in ("cp.async.bulk.tensor", "ld.global") if op in ptx)
    report.append({
        "stages": c.stages,
        "buffers": sorted({int(b) for b in buffers}),
        "bulk_copies": ptx.count("cp.async.bulk.tensor"),
        "waits_first": -1 < ptx.find("griddepcontrol.wait") < first_read,
    })
print(json.dumps(report))
"""


def test_each_tuned_shape_keeps_weight_tiles_in_flight_through_tma():
    """Compiled for sm_90: the weight tiles come by bulk tensor copies into a ring of STAGES - 1 shared
    buffers, so tiles after the one being summed are in flight (what the kernel is for), and nothing is
    read before the PDL wait."""
    report = json.loads(compiled_output(COMPILE_FOR_HOPPER, timeout=300).splitlines()[-1])
    assert len(report) == len(gemv_tma.CONFIGS)
    for shape in report:
        assert shape["bulk_copies"] > 0, shape
        assert shape["buffers"] == [shape["stages"] - 1], shape
        assert shape["waits_first"], shape


def test_the_op_boundary_sends_gemv_rows_to_the_tma_gemv_only_when_switched_on(monkeypatch):
    """ops.linear: with GEMV_TMA, on a Hopper GPU, a GEMV row whose weight a descriptor can take goes to
    gemv_tma; a weight it cannot take (a misaligned base), or the switch off, keeps the pointer GEMV."""
    from deltaserve import ops

    calls = []
    monkeypatch.setattr(ops, "_streams_weights", lambda x, w: True)
    monkeypatch.setattr("deltaserve.ops.triton.device_info.hopper_or_later", lambda device: True)
    monkeypatch.setattr(gemv_tma, "gemv_tma", lambda x, w: calls.append("tma") or F.linear(x, w))
    monkeypatch.setattr(
        triton_linear, "gemv", lambda x, w, prefetch=None: calls.append("gemv") or F.linear(x, w)
    )
    x = torch.randn(1, 64).bfloat16()
    w = torch.randn(16, 65).bfloat16()
    aligned, misaligned = w[:, :64].contiguous(), w[:, 1:]
    monkeypatch.setattr(ops, "GEMV_TMA", True)
    torch.testing.assert_close(ops.linear(x, aligned), F.linear(x, aligned))
    ops.linear(x, misaligned)
    monkeypatch.setattr(ops, "GEMV_TMA", False)
    ops.linear(x, aligned)
    assert calls == ["tma", "gemv", "gemv"]
