"""SwiGLU and gated attention's sigmoid output gate on the GPU, and the fp32 SiLU, sigmoid and rounding
helpers the other Triton kernels share.

Numerics follow the torch reference (deltaserve/ops/activation.py) in the activation dtype:
silu(gate) is computed in fp32 and rounded to the dtype, then multiplied by up (fp32 product, rounded
once). torch's CUDA SiLU is x / (1 + expf(-x)) with IEEE division; `silu_f32` uses the same libdevice
expf and a round-to-nearest division, so the GPU result is bit-identical to torch's. Triton's own
tl.exp is ex2.approx-based and would differ in the last fp32 bit. The sigmoid is torch's likewise,
1 / (1 + expf(-x)), rounded to the gate's dtype before the product.

Every narrowing cast goes through `round_to`: Triton's CPU interpreter truncates fp32 -> bf16 (the GPU
rounds to nearest even), so under the interpreter the rounding is done on the bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltaserve.ops.triton.device_info import sm_count
from deltaserve.ops.triton.launch_shape import program_shape
from deltaserve.ops.triton.pdl import gdc_enter, launch_options

# Decided at import, as Triton decides at decoration time whether kernels run in the interpreter.
_INTERPRETER: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# Triton's name of each float dtype a kernel takes as a constexpr (a product's rounding dtype).
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
if not _INTERPRETER:
    from triton.language.extra import libdevice  # the interpreter has no libdevice

# One program covers one row's BLOCK_I columns: 1024 columns over 4 warps is 8 elements (16 bytes of
# bf16) per thread and per operand, one vectorised load each; rows go on grid axis 0 (no 65535 limit).
_BLOCK_I = 1024
_NUM_WARPS = 4
# A decode step's few rows: where 1024-column programs would be fewer than the device's SMs, 256-column
# ones spread the same row over four times as many. Measured on an H200 (132 SMs) at one token: SwiGLU
# 1.25 -> 1.0-1.1 us, sigmoid gate 1.23 -> 1.07 us. From 2,048 tokens up 1024 columns stay the fastest.
_NARROW_BLOCK_I = 256


def _default_columns(num_rows: int, width: int, sms: int) -> tuple[int, int]:
    """The default program shape (columns per program, warps) for `num_rows` rows `width` columns wide
    on a device of `sms` SMs."""
    wide = num_rows * triton.cdiv(width, _BLOCK_I) >= sms
    return (_BLOCK_I if wide else _NARROW_BLOCK_I), _NUM_WARPS


@triton.jit
def exp_f32(x):
    """x: fp32. expf as torch's CUDA kernels compute it (libdevice's; tl.exp is ex2-based)."""
    if _INTERPRETER:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def mul_f32(a, b):
    """a * b in fp32, rounded on its own: never contracted with a following add into an FMA (an FMA
    skips the product's rounding, which torch's separate multiply and add keep; the compiler contracts
    even through a narrowing cast to bf16 and back, into fma.rn.bf16)."""
    if _INTERPRETER:
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def silu_f32(x):
    """x: fp32. Returns x / (1 + exp(-x)) in fp32, as torch's SiLU computes it."""
    return tl.div_rn(x, 1.0 + exp_f32(-x))


@triton.jit
def sigmoid_f32(x):
    """x: fp32. 1 / (1 + exp(-x)) in fp32, as torch's sigmoid computes it."""
    return tl.div_rn(1.0, 1.0 + exp_f32(-x))


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest even in `dtype` (as torch's .to(dtype) and the GPU's cvt.rn do)."""
    if _INTERPRETER and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # ties go to the even bf16 mantissa
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _row_block(width, BLOCK: tl.constexpr):
    """Row program_id(0) (int64) and its column block program_id(1) of a [rows, width] problem: (row,
    cols, the mask of cols inside width)."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return tl.program_id(0).to(tl.int64), cols, cols < width


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    inter,
    stride_in_row,
    stride_out_row,
    BLOCK_I: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row, cols, mask = _row_block(inter, BLOCK_I)
    src = gate_up_ptr + row * stride_in_row + cols
    gate = tl.load(src, mask=mask, other=0.0)
    up = tl.load(src + inter, mask=mask, other=0.0)
    act = round_to(silu_f32(gate.to(tl.float32)), gate.dtype)  # rounded, as F.silu(gate) is
    out = round_to(act.to(tl.float32) * up.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out_row + cols, out, mask=mask)


def silu_and_mul(
    gate_up: torch.Tensor, *, out: torch.Tensor | None = None, launch: tuple[int, int] | None = None
) -> torch.Tensor:
    """gate_up: [..., 2 * I] with the gate first (rows may be strided). Returns silu(gate) * up, [..., I],
    written into `out` when given (contiguous, gate_up's dtype). `launch`, a tuning knob: the program
    shape, (columns per program, warps), powers of two with warps <= 16; None: the module default."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {two_i}")
    inter = two_i // 2
    lead = gate_up.shape[:-1]
    rows = gate_up.reshape(-1, two_i)  # a view for 2-D inputs with unit column stride
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(*lead, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (*lead, inter) or out.dtype != gate_up.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {gate_up.dtype} tensor of shape {(*lead, inter)}")
    num_rows = rows.shape[0]
    block_i, num_warps = program_shape(
        launch, _default_columns(num_rows, inter, sm_count(out.device)), "columns"
    )
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](
        rows,
        out,
        inter,
        rows.stride(0),
        inter,
        BLOCK_I=block_i,
        num_warps=num_warps,
        **launch_options(out.device),
    )
    return out


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr,
    gate_ptr,
    out_ptr,
    width,
    head_dim,
    stride_x_row,
    stride_gate_row,
    stride_gate_head,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row, cols, mask = _row_block(width, BLOCK)
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    gate_at = gate_ptr + row * stride_gate_row + (cols // head_dim) * stride_gate_head + cols % head_dim
    gate = tl.load(gate_at, mask=mask, other=0.0)
    sig = round_to(sigmoid_f32(gate.to(tl.float32)), gate.dtype)  # rounded, as torch.sigmoid(gate) is
    out = round_to(x.to(tl.float32) * sig.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, out, mask=mask)


def sigmoid_gate(
    x: torch.Tensor,
    gate: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x: [T, H * D] with unit column stride (rows may be strided); gate: [T, H, D] with unit stride over
    D (rows and heads may be strided, as the view of the interleaved q | gate projection is). Returns
    x * sigmoid(gate) as a contiguous [T, H, D] in one pass: the bits of the torch reference
    (deltaserve/ops/activation.py), which launches a sigmoid and a multiply; written into `out` when given
    (contiguous, gate's shape and dtype). `launch`: (columns per program, warps), as silu_and_mul's."""
    if gate.dim() != 3 or x.dim() != 2 or x.shape != (gate.shape[0], gate.shape[1] * gate.shape[2]):
        raise ValueError(
            f"sigmoid_gate needs x [T, H * D] and gate [T, H, D], got {tuple(x.shape)} and {tuple(gate.shape)}"
        )
    if x.dtype != gate.dtype:
        raise ValueError(f"sigmoid_gate needs x and gate of one dtype, got {x.dtype} and {gate.dtype}")
    block, num_warps = program_shape(
        launch, _default_columns(x.shape[0], x.shape[1], sm_count(x.device)), "columns"
    )
    if x.stride(1) != 1:
        x = x.contiguous()
    if gate.stride(2) != 1:
        gate = gate.contiguous()
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.dtype != gate.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {gate.dtype} tensor of shape {tuple(gate.shape)}")
    tokens, width = x.shape
    if tokens and width:
        _sigmoid_gate_kernel[(tokens, triton.cdiv(width, block))](
            x,
            gate,
            out,
            width,
            gate.shape[2],
            x.stride(0),
            gate.stride(0),
            gate.stride(1),
            BLOCK=block,
            num_warps=num_warps,
            **launch_options(out.device),
        )
    return out
