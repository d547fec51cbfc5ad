"""Every floating-point Triton kernel, compiled for sm_90 on the CPU, has no 16-bit fused multiply-add.

The kernels round where torch rounds: a product rounded to bf16, then a sum rounded again. Compiled with
FP contraction (Triton's default), such a multiply and add, narrowed to bf16, become one fma.rn.bf16 and
the product's rounding is gone. That happened twice (the slot GEMVs' shared-expert share, the q/k RoPE
rotation: a third and a tenth of values an ulp off the unfused ops); `mul_f32` is the remedy
(ops/triton/activation.py). Compiled in one process of its own (tests/hopper_ptx.py): no GPU needed."""

from __future__ import annotations

import json

from hopper_ptx import hopper_ptx

_COMPILE_ALL = r"""
import importlib
import json

import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

INT_POINTERS = {"qsl", "seq_lens", "bt", "count", "slots", "ctx", "sorted_slots", "block_expert", "conv_slots",
                "verify_slots", "ids", "position", "slot", "pos"}
FP32_POINTERS = {"inv_freq", "part_out", "part_lse", "a_log", "dt_bias", "state", "g", "beta", "logits", "weights"}
FP32_SCALARS = {"eps", "n_cols_f32", "head_dim_f32", "qk_scale", "scale"}

KERNELS = [
    ("activation", "_silu_and_mul_kernel", dict(BLOCK_I=256, USE_GDC=True)),
    ("activation", "_sigmoid_gate_kernel", dict(BLOCK=256, USE_GDC=True)),
    ("norm", "_rms_norm_kernel", dict(HAS_RESIDUAL=True, BLOCK_R=1, BLOCK_N=64, USE_GDC=True)),
    ("norm", "_gated_rms_norm_kernel", dict(PROD_DTYPE=tl.bfloat16, BLOCK_R=1, BLOCK_D=64, USE_GDC=True)),
    *[("linear", "_gemv_kernel", dict(ROWS=1, MODE=mode, HEAD_DIM=64, K_POW2=256 if mode >= 4 else 1,
                                       SWIGLU_OUT=swiglu_out, CONV_KW=conv_kw, BLOCK_N=8, BLOCK_K=256,
                                       PREFETCH=False, PRELOAD=1, USE_GDC=True))
      for mode, swiglu_out, conv_kw in [(0, False, 0), (1, False, 0), (2, False, 0), (3, False, 0), (4, False, 0),
                                        (5, True, 0), (0, True, 0), (0, False, 4), (5, False, 4)]],
    ("linear", "_skinny_kernel", dict(BLOCK_N=64, BLOCK_K=64, USE_GDC=True)),
    ("conv1d", "_conv1d_decode_kernel", dict(KW=4, BLOCK_C=64, USE_GDC=True)),
    ("conv1d", "_conv1d_heads_kernel", dict(KW=4, BLOCK_C=64)),
    ("conv1d", "_conv1d_stream_kernel", dict(KW=4, BLOCK_T=16, BLOCK_C=64, ROWS=1)),
    ("conv1d", "_conv1d_tiles_kernel", dict(KW=4, BLOCK_T=16, BLOCK_C=64, SPILL=True)),
    ("conv1d", "_conv1d_verify_kernel", dict(KW=4, BLOCK_C=64, OUTPUTS=2)),
    ("gdn", "_gdn_decode_kernel", dict(HK=2, HV=4, DK=64, DV=64, BV=32, COUNTED_PROGRAMS=True, USE_GDC=True)),
    ("gdn", "_gdn_verify_kernel", dict(HK=2, HV=4, DK=64, DV=64, BV=32)),
    ("gdn_gating", "_gdn_gating_kernel", dict(BLOCK_T=16, BLOCK_H=16, USE_GDC=True)),
    ("attention", "_qk_norm_rope_write_kv_kernel", dict(NUM_HEADS=2, NUM_KV_HEADS=1, HEAD_DIM=64, ROTARY_DIM=32,
                                                        PAGE_SIZE=16, HEADS_PER_PROGRAM=1, USE_GDC=True)),
    ("attention", "_paged_attention_kernel", dict(NUM_HEADS=4, GROUP=2, HEAD_DIM=64, PAGE_SIZE=16, DECODE_M=16,
                                                  DECODE_N=32, PREFILL_M=64, PREFILL_N=32, HAS_DECODE=True,
                                                  HAS_PREFILL=True, SPLIT=True, DEVICE_COUNT=False,
                                                  DOT_PRECISION="ieee", USE_GDC=True)),
    ("attention", "_merge_splits_kernel", dict(NUM_HEADS=4, HEAD_DIM=64, MAX_SPLITS=4, DEVICE_COUNT=False,
                                               USE_GDC=True)),
    ("moe", "_gate_up_kernel", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="ieee", DESCRIPTORS=False)),
    ("moe", "_down_kernel", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="ieee", DESCRIPTORS=False)),
    ("moe", "_combine_kernel", dict(BLOCK_H=64)),
    ("moe_grouped", "_combine_sorted_kernel", dict(BLOCK_H=64)),
    ("moe_gemv", "_slots_gate_up_kernel", dict(TOP_K=2, HIDDEN=64, INTER=64, BLOCK_N=8, BLOCK_K=64, USE_GDC=True)),
    ("moe_gemv", "_slots_down_kernel", dict(TOP_K=2, HIDDEN=64, INTER=64, SHARED=True, BLOCK_N=8, BLOCK_K=64,
                                            USE_GDC=True)),
    ("routing", "_route_kernel", dict(TOP_K=2, K_PAD=2, RENORMALIZE=True, ROWS=1, BINS=64)),
]


def argument_type(name):
    if name.endswith("_ptr"):
        base = name[: -len("_ptr")]
        return "*i32" if base in INT_POINTERS else "*fp32" if base in FP32_POINTERS else "*bf16"
    return "fp32" if name in FP32_SCALARS else "i32"


found = {}
for module, kernel, constexprs in KERNELS:
    fn = getattr(importlib.import_module(f"deltaserve.ops.triton.{module}"), kernel)
    signature = {p.name: argument_type(p.name) for p in fn.params if not p.is_constexpr}
    signature |= {name: "constexpr" for name in constexprs}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    ops = [line.split()[0] for line in (raw.strip() for raw in ptx.splitlines()) if line]
    label = f"{kernel}" + (f" MODE={constexprs['MODE']}" if "MODE" in constexprs else "")
    label += "".join(f" {flag}" for flag in ("SWIGLU_OUT", "NORM", "CONV_KW") if constexprs.get(flag))
    found[label] = sorted({op for op in ops if op.startswith("fma") and (".bf16" in op or ".f16" in op)})
print("FOUND " + json.dumps(found))
"""


def test_no_kernel_fuses_a_16_bit_multiply_into_an_add() -> None:
    lines = hopper_ptx(_COMPILE_ALL)
    found = json.loads(next(line for line in lines if line.startswith("FOUND "))[len("FOUND ") :])
    offenders = {kernel: ops for kernel, ops in found.items() if ops}
    assert not offenders, f"16-bit FMAs (a product left unrounded): {offenders}"
