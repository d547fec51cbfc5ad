"""The op boundary. Layers call these; each picks the GPU kernel for CUDA tensors and the torch
reference (the oracle, in the sibling modules) otherwise. DELTASERVE_REFERENCE_OPS=1 forces the
reference everywhere (to bisect a GPU discrepancy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from deltaserve.ops import activation as _activation_ref
from deltaserve.ops import attention as _attention_ref
from deltaserve.ops import conv1d as _conv1d_ref
from deltaserve.ops import fresh_attention
from deltaserve.ops import gdn as _gdn_ref
from deltaserve.ops import moe as _moe_ref
from deltaserve.ops import norm as _norm_ref
from deltaserve.ops import rotary as _rotary_ref
from deltaserve.ops.batch import ForwardBatch, decode_rows_only
from deltaserve.ops.settings import (
    FUSED_GEMV,
    GEMV_ROWS,
    GEMV_TMA,
    L2_PREFETCH_MIB,
    MOE_DESCRIPTORS_FROM,
    MOE_GROUPED_FROM,
    MOE_SLOT_GEMV_SLOTS,
    REFERENCE_ONLY,
    RMS_NORM_FUSION_MAX_K,
    SKINNY_GEMM,
)
from deltaserve.ops.settings import parse_gemv_fusions as parse_gemv_fusions
from deltaserve.ops.settings import parse_prefetch_mib as parse_prefetch_mib
from deltaserve.ops.settings import parse_slot_gemv_slots as parse_slot_gemv_slots

if TYPE_CHECKING:
    from deltaserve.ops.triton.linear import DecodeConv, NextWeight


def _from_rows(threshold: int, ids: torch.Tensor, num_experts: int) -> bool:
    """Whether a routed-expert call averages `threshold` or more rows per expert (never when 0)."""
    return bool(threshold) and ids.numel() >= threshold * num_experts


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and not REFERENCE_ONLY


def _takes_slot_gemvs(x: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether a routed-experts call streams each slot's expert as a GEMV (MOE_SLOT_GEMV_SLOTS)."""
    return use_kernels(x) and ids.numel() <= MOE_SLOT_GEMV_SLOTS


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x's rows are GEMV rows (GEMV_ROWS) that may take the weight-streaming kernels."""
    return _streams_weights(x, weight) and 1 <= x.shape[0] <= GEMV_ROWS


def _streams_weights(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x's rows may take the weight-streaming kernels (ops/triton/linear.py)."""
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and use_kernels(x)
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, then: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T. One 16-bit row on the GPU (batch-1 decode; up to GEMV_ROWS rows when raised) takes
    the GEMV kernel, which streams the weight once for all its rows; up to 16 rows take the skinny GEMM
    when it is switched on (SKINNY_GEMM); everything else is F.linear (cuBLAS). With GEMV_TMA, on a Hopper
    GPU, GEMV rows take the TMA GEMV where a descriptor can take the weight. `then`: the projection the
    step streams next, whose first bytes the GEMV prefetches into L2 as it ends
    (DELTASERVE_L2_PREFETCH_MIB, `_prefetch_target`). The same for the fused linears below."""
    rows = x.shape[0]
    if _streams_weights(x, weight):
        if 1 <= rows <= GEMV_ROWS:
            if GEMV_TMA:
                from deltaserve.ops.triton.device_info import hopper_or_later
                from deltaserve.ops.triton.gemv_tma import gemv_tma, tma_refusal

                if hopper_or_later(x.device) and tma_refusal(x, weight) is None:
                    return gemv_tma(x, weight)
            from deltaserve.ops.triton.linear import gemv

            return gemv(x, weight, prefetch=_prefetch_target(rows, then))
        if SKINNY_GEMM:
            from deltaserve.ops.triton.linear import SKINNY_MAX_ROWS, skinny_gemm

            if rows <= SKINNY_MAX_ROWS:
                return skinny_gemm(x, weight)
    return F.linear(x, weight)


def _prefetch_target(rows: int, weight: torch.Tensor | None) -> NextWeight | None:
    """`weight` as the next projection to prefetch into L2 in a step of `rows` rows: at GEMV rows on a GPU
    that has the instruction (Hopper and later), with DELTASERVE_L2_PREFETCH_MIB set; else None."""
    if (
        weight is None
        or not L2_PREFETCH_MIB
        or not 1 <= rows <= GEMV_ROWS
        or not use_kernels(weight)
        or not weight.is_contiguous()
    ):
        return None
    from deltaserve.ops.triton.device_info import hopper_or_later

    if not hopper_or_later(weight.device):
        return None
    from deltaserve.ops.triton.linear import NextWeight

    return NextWeight(weight, L2_PREFETCH_MIB << 20)


def prefetch_weight(rows: int, weight: torch.Tensor | None) -> None:
    """Starts the first bytes of `weight`, a step's first projection (no GEMV before it to carry the
    prefetch, see `linear`'s `then`), streaming into L2 from a kernel of its own. Changes no value; a
    no-op where _prefetch_target says none (the reference has nothing to do)."""
    target = _prefetch_target(rows, weight)
    if target is not None:
        from deltaserve.ops.triton.prefetch import prefetch_l2

        prefetch_l2(target.weight, target.max_bytes)


def silu_and_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, then: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(silu_and_mul(gate_up), weight): a SwiGLU MLP's down projection. With the "swiglu" fusion
    (FUSED_GEMV) the GEMV's rows (see linear) compute the activation inside the GEMV, with the same bits as the two ops."""
    if "swiglu" in FUSED_GEMV and _takes_gemv(gate_up, weight):
        from deltaserve.ops.triton.linear import gemv_swiglu

        return gemv_swiglu(gate_up, weight, prefetch=_prefetch_target(gate_up.shape[0], then))
    return linear(silu_and_mul(gate_up), weight, then)


def sigmoid_gated_linear(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, then: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(x * sigmoid(gate), weight) with x [T, H * D] and gate [T, H, D] (any row and head strides):
    gated attention's output projection. With the "gate" fusion the GEMV's rows (see linear) gate inside the
    GEMV, rounded as the two ops round."""
    if "gate" in FUSED_GEMV and _takes_gemv(x, weight) and gate.stride(-1) == 1:
        from deltaserve.ops.triton.linear import gemv_sigmoid_gated

        return gemv_sigmoid_gated(x, gate, weight, prefetch=_prefetch_target(x.shape[0], then))
    return linear(sigmoid_gate(x, gate).view(x.shape), weight, then)


def gated_norm_linear(
    x: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    then: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear(gated_rms_norm(x, z, norm_weight, eps) as [T, H * D], weight) with x, z [T, H, D]: a Gated
    DeltaNet layer's output projection. With the "norm" fusion the GEMV's rows (see linear) normalise inside
    the GEMV."""
    tokens, heads, head_dim = x.shape
    if "norm" in FUSED_GEMV and 1 <= tokens <= GEMV_ROWS and use_kernels(x):
        from deltaserve.ops.triton.linear import gated_norm_problem, gemv_gated_norm

        # x.flatten(1) is a view once gated_norm_problem has found its heads adjacent
        if gated_norm_problem(x, z, norm_weight) is None and _streams_weights(x.flatten(1), weight):
            return gemv_gated_norm(x, z, norm_weight, eps, weight, prefetch=_prefetch_target(tokens, then))
    return linear(gated_rms_norm(x, z, norm_weight, eps).reshape(tokens, heads * head_dim), weight, then)


@dataclass(slots=True)
class NormedInput:
    """A layer's input, rms_norm(hidden, weight, eps, residual), not computed yet: the layer's first
    projection (normed_linear) may normalise it inside its GEMV; anything else calls `normed()`. Either
    way it is normalised once, and with a residual that computation also yields the next residual
    (hidden + residual), which `next_residual` then holds."""

    hidden: torch.Tensor
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    _sum: torch.Tensor | None = field(default=None, init=False)  # hidden + residual, once computed
    _used: bool = field(default=False, init=False)

    def _use(self) -> None:
        if self._used:
            raise RuntimeError("a layer input is normalised once: normed() or normed_linear, not both")
        self._used = True

    def normed(self) -> torch.Tensor:
        self._use()
        if self.residual is None:
            return rms_norm(self.hidden, self.weight, self.eps)
        normed, self._sum = rms_norm(self.hidden, self.weight, self.eps, self.residual)
        return normed

    @property
    def next_residual(self) -> torch.Tensor:
        """The residual after this norm: hidden itself without a residual, else hidden + residual."""
        if self.residual is None:
            return self.hidden
        if self._sum is None:
            raise RuntimeError("the layer input was never normalised, so the next residual is not computed")
        return self._sum


def as_tensor(x: torch.Tensor | NormedInput) -> torch.Tensor:
    """x itself, or a pending layer input normalised."""
    return x if isinstance(x, torch.Tensor) else x.normed()


def normed_linear(
    x: torch.Tensor | NormedInput, weight: torch.Tensor, then: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(as_tensor(x), weight): a layer's first projection. With the "rmsnorm" fusion the GEMV's rows
    (see linear) normalise a pending input inside the GEMV (ops/triton/linear.py gemv_rms_norm)."""
    if isinstance(x, torch.Tensor):
        return linear(x, weight, then)
    if _fuses_input_norm(x, weight):
        return _gemv_over_norm(x, weight, then, swiglu_out=False)
    return linear(x.normed(), weight, then)


def _fuses_input_norm(x: NormedInput, weight: torch.Tensor) -> bool:
    """Whether the "rmsnorm" fusion takes x's norm into a GEMV over `weight` (ops/triton/linear.py)."""
    h, residual = x.hidden, x.residual
    if not (
        "rmsnorm" in FUSED_GEMV
        and _takes_gemv(h, weight)
        and (residual is None or (residual.dtype == h.dtype and residual.stride(-1) == 1))
        and x.weight.dtype == h.dtype
    ):
        return False
    from deltaserve.ops.triton.linear import RMS_NORM_MAX_K

    return h.shape[1] <= min(RMS_NORM_MAX_K, RMS_NORM_FUSION_MAX_K)


def _gemv_over_norm(
    x: NormedInput,
    weight: torch.Tensor,
    then: torch.Tensor | None,
    *,
    swiglu_out: bool = False,
    conv: DecodeConv | None = None,
) -> torch.Tensor:
    from deltaserve.ops.triton.linear import gemv_rms_norm

    x._use()
    rows = x.hidden.shape[0]
    y, x._sum = gemv_rms_norm(
        x.hidden,
        x.weight,
        x.eps,
        weight,
        residual=x.residual,
        swiglu_out=swiglu_out,
        conv=conv,
        prefetch=_prefetch_target(rows, then),
    )
    return y


def in_proj_conv(
    x: torch.Tensor | NormedInput,
    in_proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    batch: ForwardBatch,
    b1: int,
    b2: int,
    then: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's in_proj and causal conv: (proj [T, N], and q, k, v: silu(conv) of proj's
    first C = conv_weight.shape[0] columns cut at b1 and b2). With the "conv" fusion (FUSED_GEMV), in a
    batch of decode rows only at GEMV rows (see linear), the in_proj GEMV convolves those columns as it
    writes them and shifts each row's conv window (over the pending norm too with "rmsnorm"): q, k, v are
    then views of proj. Otherwise normed_linear, then causal_conv1d_split."""
    h = x if isinstance(x, torch.Tensor) else x.hidden
    rows, channels = h.shape[0], conv_weight.shape[0]
    if "conv" in FUSED_GEMV and _takes_gemv(h, in_proj) and decode_rows_only(batch, rows):
        from deltaserve.ops.triton.linear import DecodeConv, gemv

        conv = DecodeConv(conv_weight, conv_state, batch.state_slots[:rows])
        if isinstance(x, NormedInput) and _fuses_input_norm(x, in_proj):
            proj = _gemv_over_norm(x, in_proj, then, conv=conv)
        else:
            proj = gemv(as_tensor(x), in_proj, prefetch=_prefetch_target(rows, then), conv=conv)
        return proj, proj[:, :b1], proj[:, b1:b2], proj[:, b2:channels]
    proj = normed_linear(x, in_proj, then)
    return proj, *causal_conv1d_split(proj[:, :channels], conv_weight, conv_state, batch, b1, b2)


def swiglu_mlp(
    x: torch.Tensor | NormedInput,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    then: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(silu_and_mul(gate_up(x))): a dense SwiGLU MLP, x possibly its pending input norm. With the
    "swiglu_out" fusion the gate_up GEMV's rows (see linear) write the activation, never [gate | up] (over
    the pending norm too with "rmsnorm"); otherwise normed_linear, then silu_and_mul_linear."""
    h = x if isinstance(x, torch.Tensor) else x.hidden
    if "swiglu_out" in FUSED_GEMV and _takes_gemv(h, gate_up):
        from deltaserve.ops.triton.linear import gemv_swiglu_out

        if isinstance(x, NormedInput) and _fuses_input_norm(x, gate_up):
            act = _gemv_over_norm(x, gate_up, down, swiglu_out=True)
        else:
            act = gemv_swiglu_out(as_tensor(x), gate_up, prefetch=_prefetch_target(h.shape[0], down))
        return linear(act, down, then)
    return silu_and_mul_linear(normed_linear(x, gate_up, down), down, then)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing: (weights [T, k] in the logits' dtype, expert ids [T, k] int64)."""
    if use_kernels(router_logits):
        from deltaserve.ops.triton.routing import route as kernel

        return kernel(router_logits, top_k, renormalize)
    return _moe_ref.route(router_logits, top_k, renormalize)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Routed experts of an MoE block: sum over each token's experts of weight * down(silu(gate x) * up x).
    On the GPU: a GEMV per routing slot up to MOE_SLOT_GEMV_SLOTS slots, else the Triton kernels, or the
    grouped GEMM from MOE_GROUPED_FROM rows per expert."""
    if _takes_slot_gemvs(x, ids):
        from deltaserve.ops.triton.moe_gemv import slot_experts

        return slot_experts(x, w13, w2, weights, ids)
    if use_kernels(x):
        if _from_rows(MOE_GROUPED_FROM, ids, w13.shape[0]):
            from deltaserve.ops.triton.moe_grouped import grouped_experts, grouped_gemm_supported

            if grouped_gemm_supported(x):
                return grouped_experts(x, w13, w2, weights, ids)
        from deltaserve.ops.triton.moe import descriptors_fit
        from deltaserve.ops.triton.moe import fused_experts as kernel

        descriptors = _from_rows(MOE_DESCRIPTORS_FROM, ids, w13.shape[0]) and descriptors_fit(x, w13, w2, ids)
        return kernel(x, w13, w2, weights, ids, descriptors=descriptors)
    return _moe_ref.fused_experts(x, w13, w2, weights, ids)


def moe_block_output(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor,
    shared_gate: torch.Tensor,
    then: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Qwen3.5 MoE block's output from its routing and its shared expert's output `shared`: the routed
    experts' sum + shared * sigmoid(x @ shared_gate^T) (shared_gate [1, H]), rounded where those ops round.
    Up to MOE_SLOT_GEMV_SLOTS slots on the GPU, one kernel adds the gated shared output to the routed sum
    as it writes it. `then`: the weight the step streams next (prefetched at GEMV rows: linear)."""
    if _takes_slot_gemvs(x, ids):
        from deltaserve.ops.triton.moe_gemv import SharedExpertOutput, slot_experts

        return slot_experts(x, w13, w2, weights, ids, shared=SharedExpertOutput(shared, shared_gate[0]))
    routed = fused_experts(x, w13, w2, weights, ids)
    return routed + shared * torch.sigmoid(linear(x, shared_gate, then))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if use_kernels(x):
        from deltaserve.ops.triton.norm import rms_norm as kernel

        return kernel(x, weight, eps, residual)
    return _norm_ref.rms_norm(x, weight, eps, residual)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_kernels(x):
        from deltaserve.ops.triton.norm import gated_rms_norm as kernel

        return kernel(x, z, weight, eps)
    return _norm_ref.gated_rms_norm(x, z, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_kernels(gate_up):
        from deltaserve.ops.triton.activation import silu_and_mul as kernel

        return kernel(gate_up)
    return _activation_ref.silu_and_mul(gate_up)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) as [T, H, D]: one kernel on the GPU (it reads the strided gate in place)."""
    if use_kernels(x):
        from deltaserve.ops.triton.activation import sigmoid_gate as kernel

        return kernel(x, gate)
    return _activation_ref.sigmoid_gate(x, gate)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    if use_kernels(x):
        from deltaserve.ops.triton.conv1d import causal_conv1d as kernel

        return kernel(x, weight, conv_state, batch)
    return _conv1d_ref.causal_conv1d(x, weight, conv_state, batch)


def causal_conv1d_split(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch, b1: int, b2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """silu(conv(x)) cut at channels b1 and b2 (q, k, v). The kernel writes the three parts as
    contiguous tensors; the reference returns column views of its [T, C] result."""
    if use_kernels(x):
        from deltaserve.ops.triton.conv1d import causal_conv1d as kernel

        return kernel(x, weight, conv_state, batch, split=(b1, b2))
    y = _conv1d_ref.causal_conv1d(x, weight, conv_state, batch)
    return y[:, :b1], y[:, b1:b2], y[:, b2:]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    if use_kernels(q):
        from deltaserve.ops.triton.gdn import gated_delta_rule as kernel

        return kernel(q, k, v, a, b, A_log, dt_bias, ssm_state, batch)
    return _gdn_ref.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, batch)


def qk_norm_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Zero-centred RMSNorm of q and k per head, partial RoPE, K/V into the paged cache; returns q."""
    if use_kernels(q):
        from deltaserve.ops.triton.attention import qk_norm_rope_write_kv as kernel

        return kernel(q, k, v, q_norm_w, k_norm_w, eps, positions, inv_freq, k_cache, v_cache, slot_mapping)
    cos, sin = _rotary_ref.rotary_cos_sin(positions, inv_freq, q.dtype)
    q = _rotary_ref.apply_rotary(_norm_ref.rms_norm(q, q_norm_w, eps), cos, sin)
    k = _rotary_ref.apply_rotary(_norm_ref.rms_norm(k, k_norm_w, eps), cos, sin)
    _attention_ref.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    if use_kernels(q):
        from deltaserve.ops.triton.attention import paged_attention as kernel

        first = fresh_attention.fresh_tail(batch) if fresh_attention.applies(q.dtype) else None
        if first is None:
            return kernel(q, k_cache, v_cache, batch, scale)
        out = kernel(q, k_cache, v_cache, batch, scale, seqs=first)
        fresh_attention.attend_fresh(q, k_cache, v_cache, batch, scale, first, out)
        return out
    return _attention_ref.paged_attention(q, k_cache, v_cache, batch, scale)
