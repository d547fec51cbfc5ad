"""Gated delta rule on the GPU.

Decode rows (one token each, state from the slot pool): a Triton kernel that fuses the gating
(g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) rounded to the activation dtype), the q/k
L2 norms, the state update and the readout, reading and writing each row's SSM state IN PLACE at its
slot. Its grid depends only on tensor shapes, so it is CUDA-graph capturable.

Verify rows (a few tokens each, context > 0): the same math in a kernel whose programs each walk their
row's tokens in order, the state in registers, storing it after every token to that token's slot in
verify_state_slots (the row's own slot after its last token). Token ranges come from query_start_loc on
the device and the grid from shapes, so a batch of decode and verify rows is CUDA-graph capturable too.

Prefill chunks: fla's chunked kernel over the varlen batch (cu_seqlens), initial states gathered from
the slots (zero where the sequence has no context: a stale slot is never read), final states scattered
back. Same math as deltaserve/ops/gdn.py, which is the oracle.

A prefill graph's batch (ForwardBatch.graph_decodes) holds its leading decode rows as one-token
varlen sequences, their count on the device only. fla then runs over its own sequence list
(PrefillIndex): the decode rows' tokens as one discarded sequence (zero initial state, final state to
the reserved slot), then the prompt chunks; the decode kernel runs over the leading rows after it, its
programs past the count exiting at once, and overwrites the decode rows' outputs. So a decode row
costs its state's one read and write, as in a decode step, and fla's state gather, scatter and
per-chunk states scale with the prompt chunks, not with every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.ops.batch import ForwardBatch, fla_chunk_list, to_device
from deltaserve.ops.triton.gdn_gating import gdn_gating
from deltaserve.ops.triton.narrow_import import import_narrowly
from deltaserve.ops.triton.pdl import gdc_enter, launch_options


@triton.jit
def _gdn_decode_row(
    row,
    hv,
    vb,
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    stride_qk_row,
    stride_v_row,
    stride_ab_row,
    stride_state_slot,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    """One decode row's step for value head hv, value block vb, its state read and written in place."""
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, DK)
    offs_v = vb * BV + tl.arange(0, BV)
    row64 = tl.cast(row, tl.int64)  # a plain int in the interpreter's loops

    q = tl.load(q_ptr + row64 * stride_qk_row + hk * DK + offs_k).to(tl.float32)
    k = tl.load(k_ptr + row64 * stride_qk_row + hk * DK + offs_k).to(tl.float32)
    v = tl.load(v_ptr + row64 * stride_v_row + hv * DV + offs_v).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)

    a = tl.load(a_ptr + row64 * stride_ab_row + hv).to(tl.float32)
    b_raw = tl.load(b_ptr + row64 * stride_ab_row + hv)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus)

    slot = tl.load(slots_ptr + row).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_state_slot + hv * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s_ptrs).to(tl.float32) * decay
    kv_mem = tl.sum(s * k[:, None], axis=0)
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty))
    tl.store(out_ptr + row64 * HV * DV + hv * DV + offs_v, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _gdn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    count_ptr,
    stride_qk_row,
    stride_v_row,
    stride_ab_row,
    stride_state_slot,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    COUNTED_PROGRAMS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Without a count (COUNTED_PROGRAMS == 0) one row per program; with one, COUNTED_PROGRAMS row
    programs walk rows pid, pid + COUNTED_PROGRAMS, ... below count_ptr[0], so that a grid sized for
    the most rows a graph can hold costs few empty programs when it holds few (each costs a few ns)."""
    gdc_enter(USE_GDC)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    if COUNTED_PROGRAMS == 0:
        rows_from, rows_to, rows_step = tl.program_id(0), tl.program_id(0) + 1, 1
    else:
        rows_from, rows_to, rows_step = tl.program_id(0), tl.load(count_ptr), COUNTED_PROGRAMS
    for row in range(rows_from, rows_to, rows_step):
        _gdn_decode_row(
            row, hv, vb, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr,
            out_ptr, stride_qk_row, stride_v_row, stride_ab_row, stride_state_slot, scale, HK, HV, DK, DV, BV,
        )  # fmt: skip


# Row programs of the decode kernel with a device count: 16 x (value heads x value blocks) programs,
# ~2k at the 4B/9B shapes, whatever the graph's row capacity; each walks count / 16 rows.
_COUNTED_ROW_PROGRAMS = 16


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    count: torch.Tensor | None = None,
) -> None:
    """One token per row. q, k: [N, HK, DK] and v: [N, HV, DV] (rows may be strided views); a, b: [N, HV];
    ssm_state: [slots, HV, DK, DV] updated in place at `slots` [N]; writes out [N, HV, DV]. With
    `count` (a one-element device tensor), only its first count[0] <= N rows: the others' state and
    output are left as they are, and N comes from shapes alone (CUDA-graph capturable)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if n == 0:
        return
    assert q.stride(1) == dk and q.stride(2) == 1 and k.stride() == q.stride()
    assert v.stride(1) == dv and v.stride(2) == 1 and a.stride(1) == 1 and b.stride() == a.stride()
    assert ssm_state.is_contiguous() and out.is_contiguous()
    block_v = min(dv, 32)
    row_programs = n if count is None else min(n, _COUNTED_ROW_PROGRAMS)
    _gdn_decode_kernel[(row_programs, hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        ssm_state,
        slots,
        out,
        slots if count is None else count,  # unread without a count
        q.stride(0),
        v.stride(0),
        a.stride(0),
        ssm_state.stride(0),
        dk**-0.5,
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BV=block_v,
        COUNTED_PROGRAMS=0 if count is None else row_programs,
        **launch_options(q.device),
    )


@triton.jit(do_not_specialize=["first_seq"])
def _gdn_verify_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slots_ptr,
    qsl_ptr,
    verify_slots_ptr,
    out_ptr,
    first_seq,
    stride_qk_row,
    stride_v_row,
    stride_ab_row,
    stride_state_slot,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    """Verify row first_seq + program_id(0), value head program_id(1), value block program_id(2): the
    decode kernel's step for each of the row's tokens. Each program reads and writes only its own
    (head, value block) tile of the state, and reads the row's slot before its first store."""
    seq = first_seq + tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, DK)
    offs_v = vb * BV + tl.arange(0, BV)
    tile = hv * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    first_token = start.to(tl.int64)
    verify_base = tl.load(qsl_ptr + first_seq)  # the verify rows' first token: verify_slots[0]
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    neg_a = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))

    slot = tl.load(slots_ptr + seq).to(tl.int64)
    s = tl.load(state_ptr + slot * stride_state_slot + tile).to(tl.float32)
    for i in range(0, n):
        row64 = first_token + i
        q = tl.load(q_ptr + row64 * stride_qk_row + hk * DK + offs_k).to(tl.float32)
        k = tl.load(k_ptr + row64 * stride_qk_row + hk * DK + offs_k).to(tl.float32)
        v = tl.load(v_ptr + row64 * stride_v_row + hv * DV + offs_v).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)

        a = tl.load(a_ptr + row64 * stride_ab_row + hv).to(tl.float32)
        b_raw = tl.load(b_ptr + row64 * stride_ab_row + hv)
        beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
        x = a + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        decay = tl.exp(neg_a * softplus)

        s = s * decay
        kv_mem = tl.sum(s * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + row64 * HV * DV + hv * DV + offs_v, o.to(out_ptr.dtype.element_ty))
        dst = tl.load(verify_slots_ptr + (row64 - verify_base)).to(tl.int64)
        tl.store(state_ptr + dst * stride_state_slot + tile, s.to(state_ptr.dtype.element_ty))


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: ForwardBatch,
    out: torch.Tensor,
) -> None:
    """The batch's verify rows (sequences num_decodes .. num_decodes + num_verify - 1). q, k, v, a, b and
    out span the whole batch ([T, ...], as for gdn_decode); ssm_state: [slots, HV, DK, DV], read at the
    rows' state_slots and written at batch.verify_state_slots."""
    nv = batch.num_verify
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    if nv == 0:
        return
    assert batch.verify_state_slots is not None
    assert q.stride(1) == dk and q.stride(2) == 1 and k.stride() == q.stride()
    assert v.stride(1) == dv and v.stride(2) == 1 and a.stride(1) == 1 and b.stride() == a.stride()
    assert ssm_state.is_contiguous() and out.is_contiguous()
    block_v = min(dv, 32)
    _gdn_verify_kernel[(nv, hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        ssm_state,
        batch.state_slots,
        batch.query_start_loc,
        batch.verify_state_slots,
        out,
        batch.num_decodes,
        q.stride(0),
        v.stride(0),
        a.stride(0),
        ssm_state.stride(0),
        dk**-0.5,
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BV=block_v,
    )


@dataclass(slots=True)
class PrefillIndex:
    """fla's sequences: their varlen layout, slots and contexts, built once per batch. Passing the chunk
    index (and the same cu_seqlens tensor to every layer) keeps fla from rebuilding it per layer, which
    costs a blocking host->device copy each time. Eagerly these are the batch's sequences from `first`
    on; a prefill graph names its own (module docstring)."""

    first: int  # first prefill sequence of the batch
    start: int  # its first token row: fla runs over the tokens from here on
    cu_seqlens: torch.Tensor  # [P + 1] int64 on the device
    cu_seqlens_cpu: (
        torch.Tensor | None
    )  # the same on the host (None: fla needs it only without chunk_indices)
    chunk_indices: torch.Tensor  # [chunks, 2] int64 on the device: (sequence, chunk within it)
    state_slots: torch.Tensor  # [P] int64: each sequence's state slot
    context_lens: torch.Tensor  # [P] int32: > 0 where the sequence starts from its slot, else from zeros


def prefill_index(batch: ForwardBatch, first: int) -> PrefillIndex:
    cached = batch.gdn_prefill_index
    if isinstance(cached, PrefillIndex) and cached.first == first:
        return cached
    lens = batch.query_lens_host[first:]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    chunks = fla_chunk_list(lens)
    device = batch.query_start_loc.device
    index = PrefillIndex(
        first=first,
        start=sum(batch.query_lens_host[:first]),
        cu_seqlens=to_device(cu, torch.int64, device),
        cu_seqlens_cpu=torch.tensor(cu, dtype=torch.int64),
        chunk_indices=to_device(chunks, torch.int64, device).view(-1, 2),
        state_slots=batch.state_slots[first:],
        context_lens=batch.context_lens[first:],
    )
    batch.gdn_prefill_index = index
    return index


# The module of fla's chunked kernel, and the packages that stand as plain ones while it imports: fla's
# and fla.ops' initialisers (every fla layer, model and op), gated_delta_rule's (its recurrent and naive
# kernels), and fla.modules' and fla.modules.norm's (every fla module, torch.distributed.tensor and
# sympy with them), of which the kernel needs one function, l2norm's.
FLA_CHUNK_MODULE = "fla.ops.gated_delta_rule.chunk"
FLA_CHUNK_PLAIN_PACKAGES = ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.modules", "fla.modules.norm")


def fla_chunk_gated_delta_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """fla's chunked kernel, imported without the rest of fla (ops/triton/narrow_import.py) the first
    time; after it, a lookup in sys.modules."""
    return import_narrowly(FLA_CHUNK_MODULE, FLA_CHUNK_PLAIN_PACKAGES, "fla-core").chunk_gated_delta_rule


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: ForwardBatch,
    first: int,
) -> torch.Tensor:
    """fla's sequences (prefill_index: eagerly the batch's sequences first..B-1, tokens from
    query_start_loc[first] on), any lengths, through fla's chunked kernel. Returns o for those tokens."""
    chunk_gated_delta_rule = fla_chunk_gated_delta_rule()
    index = prefill_index(batch, first)
    start = index.start
    slots = index.state_slots
    has_context = (index.context_lens > 0)[:, None, None, None]
    initial = torch.where(has_context, ssm_state[slots].float(), 0.0)
    g, beta = gdn_gating(a[start:], b[start:], A_log, dt_bias)
    out, final = chunk_gated_delta_rule(
        q[start:].unsqueeze(0),
        k[start:].unsqueeze(0),
        v[start:].unsqueeze(0),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=index.cu_seqlens,
        cu_seqlens_cpu=index.cu_seqlens_cpu,
        chunk_indices=index.chunk_indices,
    )
    ssm_state[slots] = final.to(ssm_state.dtype)
    return out[0]


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
    """The GPU path of deltaserve.ops.gdn.gated_delta_rule (same signature and semantics): decode rows
    through the decode kernel, verify rows through the verify kernel, the rest through fla."""
    nd = batch.num_decodes
    if nd + batch.num_verify == 0 and batch.graph_decodes is None and batch.num_seqs:
        return gdn_prefill(q, k, v, a, b, A_log, dt_bias, ssm_state, batch, 0)  # fla's o is every row's
    tokens = q.shape[0]
    out = torch.empty(tokens, v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    if nd:
        gdn_decode(
            q[:nd],
            k[:nd],
            v[:nd],
            a[:nd],
            b[:nd],
            A_log,
            dt_bias,
            ssm_state,
            batch.state_slots[:nd],
            out[:nd],
        )
    gdn_verify(q, k, v, a, b, A_log, dt_bias, ssm_state, batch, out)
    first = nd + batch.num_verify
    if first < batch.num_seqs:
        start = prefill_index(batch, first).start
        out[start:] = gdn_prefill(q, k, v, a, b, A_log, dt_bias, ssm_state, batch, first)
    if batch.graph_decodes is not None:  # after fla: its outputs for these rows are discarded
        rows = min(tokens, batch.num_seqs)
        gdn_decode(
            q[:rows],
            k[:rows],
            v[:rows],
            a[:rows],
            b[:rows],
            A_log,
            dt_bias,
            ssm_state,
            batch.state_slots[:rows],
            out[:rows],
            count=batch.graph_decodes,
        )
    return out
