"""The kernels' environment settings (DELTASERVE_*), read once at import and strictly: a typo names the
variable and the value instead of silently meaning a default. The op boundary (ops/__init__.py) reads
them as its module globals, so a test may patch them there; a kernel module reads its own (the GEMV
preload) with the same parsers."""

from __future__ import annotations

import os


def parse_switch(variable: str, text: str) -> bool:
    """`text` as the value of `variable`: "1" on, "0" off (surrounding spaces allowed); ValueError naming
    the variable and the value otherwise."""
    value = text.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{variable} must be 0 or 1, got {text!r}")
    return value == "1"


REFERENCE_ONLY = os.environ.get("DELTASERVE_REFERENCE_OPS", "") == "1"
# DELTASERVE_SKINNY_GEMM=1 sends 2..16-row 16-bit linears to the skinny GEMM instead of cuBLAS. Off by
# default: on an H200 at the 4B shape it measured level with cuBLAS at 16 decode rows (see the record
# in docs/benchmarks), and it has not yet been through the GPU gate.
SKINNY_GEMM = os.environ.get("DELTASERVE_SKINNY_GEMM", "0") == "1"
# DELTASERVE_GEMV_ROWS=N (1..4) sends 16-bit linears of up to N rows to the GEMV, which streams the weight
# once for all of them (a K = 3 verify row has 4 tokens). Default 1 (batch-1 decode only): at 4 rows it
# measured slower than cuBLAS on an H200 (K = 3 verify steps: TPOT 1.73 against 1.19 ms;
# docs/benchmarks/2026-12-02-h200-mtp-c1-target.md).
GEMV_ROWS = int(os.environ.get("DELTASERVE_GEMV_ROWS", "1"))
if not 1 <= GEMV_ROWS <= 4:
    raise ValueError(f"DELTASERVE_GEMV_ROWS must be 1..4, got {GEMV_ROWS}")
# DELTASERVE_GEMV_TMA=1 sends plain GEMV rows (no fusion) to the GEMV that streams its weight through TMA
# (ops/triton/gemv_tma.py) where a descriptor can take the weight. Off by default: on an H100, autotuned,
# it streams the 4B's layer projections 4-16% slower than the pointer GEMV
# (docs/benchmarks/2026-12-06-h100-gemv-tma.md); an H200 is not yet measured. It drops their L2 prefetch.
GEMV_TMA = parse_switch("DELTASERVE_GEMV_TMA", os.environ.get("DELTASERVE_GEMV_TMA", "0"))
# DELTASERVE_FUSED_GEMV moves a short op beside a GEMV row's projection into the GEMV, as a comma list
# or "1" for all of them. Before the projection: "swiglu" (silu_and_mul_linear), "gate"
# (sigmoid_gated_linear), "norm" (gated_norm_linear), "rmsnorm" (a layer's input RMSNorm and residual add:
# normed_linear). After it: "swiglu_out" (a dense MLP's activation, written by its gate_up GEMV:
# swiglu_mlp; it takes precedence over "swiglu"), "conv" (a Gated DeltaNet layer's causal conv, applied
# by its in_proj GEMV in steps of decode rows only: in_proj_conv). Default "rmsnorm,swiglu_out,conv" (120
# fewer kernels per 4B step): 4B c1 TPOT 3.34 ms against 3.52 unfused on one H100, alternating runs, and
# the whole 4B GPU gate passes with them (docs/benchmarks/2026-12-06-h100-fusions-default.md); "0" turns
# them off. "swiglu", "gate" and "norm" stay off: on an H200 they measured no faster together (4B c1 TPOT
# 3.064 ms against 3.056 unfused: the SwiGLU GEMV loses 1.9 us per layer, "gate" and "norm" save 2.1 and
# 0.3 us; docs/benchmarks/2026-12-04-h200-c1-fusions-graph-attention.md).
GEMV_FUSIONS = ("swiglu", "gate", "norm", "rmsnorm", "swiglu_out", "conv")
DEFAULT_GEMV_FUSIONS = "rmsnorm,swiglu_out,conv"
# The "rmsnorm" fusion takes rows of at most this many values. Its GEMV holds the whole row (padded to a
# power of two) for the sum of squares before the first weight block. Compiled for sm_90 (Triton 3.9's
# ptxas), the six tuned block shapes take 80-136 registers at 4,096 (the 4B's 2,560, where the fusion was
# measured, and the 9B's 4,096) and 127-237 at 8,192, one of them spilling (the plain GEMV: 48-183).
# The 27B's 5,120-wide rows stay on the measured path (the norm kernel, then the GEMV) until measured
# (python3 -m deltaserve.bench.gemv_registers prints the counts).
RMS_NORM_FUSION_MAX_K = 4096


def parse_gemv_fusions(text: str) -> frozenset[str]:
    """DELTASERVE_FUSED_GEMV's value: "" or "0" none, "1" or "all" every fusion, else a comma list."""
    text = text.strip().lower()
    if text in ("", "0"):
        return frozenset()
    if text in ("1", "all"):
        return frozenset(GEMV_FUSIONS)
    names = frozenset(name.strip() for name in text.split(","))
    unknown = sorted(names - set(GEMV_FUSIONS))
    if unknown:
        raise ValueError(
            f"DELTASERVE_FUSED_GEMV: unknown fusion(s) {', '.join(map(repr, unknown))}; expected 0, 1, all "
            f"or a comma list of {', '.join(GEMV_FUSIONS)}, got {text!r}"
        )
    return names


FUSED_GEMV = parse_gemv_fusions(os.environ.get("DELTASERVE_FUSED_GEMV", DEFAULT_GEMV_FUSIONS))


def parse_count(variable: str, unit: str, text: str) -> int:
    """An environment setting that counts `unit`s: an integer, 0 (off) or more; ValueError naming the
    variable and the value otherwise."""
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{variable} must be an integer >= 0 ({unit}), got {text!r}")
    return count


def parse_prefetch_mib(text: str) -> int:
    """DELTASERVE_L2_PREFETCH_MIB's value: MiB of each next weight to prefetch, 0 (off) or more."""
    return parse_count("DELTASERVE_L2_PREFETCH_MIB", "MiB", text)


# DELTASERVE_L2_PREFETCH_MIB=N: at GEMV rows (see linear), each projection's GEMV prefetches the first N
# MiB of the next projection's weight into L2 as it ends (ops/triton/prefetch.py), to stream under the
# short kernels between the two. 0 turns it off. Default 4: on an H100 at the 4B shape, c1 over HTTP,
# TPOT 3.54 ms against 3.57 (two runs against three); 16 MiB measured 3.69 ms, slower than none
# (docs/benchmarks/2026-12-06-h100-l2-prefetch.md).
L2_PREFETCH_MIB = parse_prefetch_mib(os.environ.get("DELTASERVE_L2_PREFETCH_MIB", "4"))


def _rows_per_expert_setting(name: str) -> int:
    """A DELTASERVE_MOE_*_FROM threshold in rows per expert: 0 (off) or more."""
    value = int(os.environ.get(name, "0"))
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


# DELTASERVE_MOE_GROUPED_FROM=N: routed-expert calls averaging N or more rows per expert (T * k / E) take
# torch's grouped GEMM (ops/triton/moe_grouped.py) where it is supported, the Triton kernels otherwise;
# 0 (the default) keeps the Triton kernels everywhere: on an H200 at the 35B-A3B's expert shape the
# grouped GEMM measured 0.70x to 0.87x of them from 64 to 4,096 tokens and 0.93x at 8,192 (in CUDA graphs;
# docs/benchmarks/2026-12-03-h200-moe-kernel-order.md).
MOE_GROUPED_FROM = _rows_per_expert_setting("DELTASERVE_MOE_GROUPED_FROM")
# DELTASERVE_MOE_DESCRIPTORS_FROM=N: the Triton kernels' calls averaging N or more rows per expert read the
# expert weights through TMA tensor descriptors (ops/triton/moe.py) where the GPU has them (9.0+) and the
# tiles divide the expert shape; 0 (the default) keeps pointer loads everywhere: on an H100 at the 35B-A3B's
# expert shape they measured 1.03x the pointer loads at 4,608 tokens and 1.00x at 2,560, too little to
# show over HTTP (docs/benchmarks/2026-12-05-h100-moe-descriptors-gate-tp.md).
MOE_DESCRIPTORS_FROM = _rows_per_expert_setting("DELTASERVE_MOE_DESCRIPTORS_FROM")


def parse_slot_gemv_slots(text: str) -> int:
    """DELTASERVE_MOE_SLOT_GEMV_SLOTS's value: routing slots (tokens x k), 0 (off) or more."""
    return parse_count("DELTASERVE_MOE_SLOT_GEMV_SLOTS", "slots", text)


# DELTASERVE_MOE_SLOT_GEMV_SLOTS=N: routed-expert calls of up to N slots (tokens x experts per token)
# stream each slot's expert as a GEMV (ops/triton/moe_gemv.py: two kernels, no grouping, the shared
# expert's gated share added by the second) instead of the grouped kernels; 0 turns it off. The default
# is 32 slots (a 35B-A3B's batches of up to 4 at 8 experts a token). On an H100 at the 35B-A3B shape over
# HTTP: c1 TPOT 3.50 ms against 4.59 ms with the grouped kernels
# (docs/benchmarks/2026-12-06-h100-slot-gemv-default.md); c4 6.19 ms against 7.11 ms, twice each
# (docs/benchmarks/2026-12-06-h100-gate-rope-moe-tails-slots32.md). Each slot's programs compute the
# same whatever the number of slots; the GPU gate's tiny-MoE surfaces passed with the bound at 16 and at
# 32 (docs/benchmarks/2026-12-06-h100-gemv-preload.md).
MOE_SLOT_GEMV_SLOTS = parse_slot_gemv_slots(os.environ.get("DELTASERVE_MOE_SLOT_GEMV_SLOTS", "32"))
