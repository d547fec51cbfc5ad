"""Gated delta rule over varlen sequences with per-sequence SSM state slots (torch reference).

Per value head h (key head h // (HV / HK)), state S in R^{dk x dv}, all in fp32:
    q, k <- l2norm(q), l2norm(k);  q <- q * dk^-0.5
    S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t
with the gating g = -exp(A_log) * softplus(a + dt_bias) in fp32 and beta = sigmoid(b) in the
activation dtype (as HF rounds it). A sequence with context 0 starts from S = 0 (its slot's old
contents, possibly stale, are never read); otherwise from its slot. The final S is written back to the
slot (cast to the pool's dtype). A verify row (ForwardBatch.num_verify) writes S after each of its
tokens t to slot verify_state_slots[t] (the last one is the row's own slot); S stays fp32 between its
tokens, as in a prefill chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.batch import ForwardBatch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta): log-decay in fp32, and beta = sigmoid(b) rounded to b's dtype."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


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
    """q, k: [T, HK, dk]; v: [T, HV, dv]; a, b: [T, HV] (decay and beta inputs); A_log, dt_bias: [HV];
    ssm_state: [slots, HV, dk, dv]. Returns o: [T, HV, dv] in v's dtype."""
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    num_v_heads = v.shape[1]
    group = num_v_heads // q.shape[1]
    qf = l2norm(q.float().repeat_interleave(group, dim=1))
    kf = l2norm(k.float().repeat_interleave(group, dim=1))
    qf = qf * qf.shape[-1] ** -0.5
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)

    # Decode rows: one vectorised step for all of them.
    nd = batch.num_decodes
    if nd:
        slots = batch.state_slots[:nd]
        state = ssm_state[slots].float()
        state, out[:nd] = _step(state, qf[:nd], kf[:nd], vf[:nd], gf[:nd], bf[:nd])
        ssm_state[slots] = state.to(ssm_state.dtype)
    # Verify rows and prefill chunks: token by token. Decode rows hold one token each, so the verify
    # rows' tokens start at row nd: token t of the batch is token t - nd of verify_state_slots.
    verify_end = nd + batch.num_verify
    start = nd
    for i in range(nd, batch.num_seqs):
        n, ctx = batch.query_lens_host[i], batch.context_lens_host[i]
        slot = batch.state_slots[i]
        if ctx > 0:
            state = ssm_state[slot].float()[None]  # read before any write: _step returns new tensors
        else:
            state = vf.new_zeros(1, num_v_heads, kf.shape[-1], vf.shape[-1])
        for t in range(start, start + n):
            state, out[t : t + 1] = _step(
                state, qf[t : t + 1], kf[t : t + 1], vf[t : t + 1], gf[t : t + 1], bf[t : t + 1]
            )
            if i < verify_end:
                ssm_state[batch.verify_state_slots[t - nd]] = state[0].to(ssm_state.dtype)
        if i >= verify_end:
            ssm_state[slot] = state[0].to(ssm_state.dtype)
        start += n
    return out.to(v.dtype)


def _step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for N independent rows. state: [N, H, dk, dv]; q, k: [N, H, dk]; v: [N, H, dv]; g, beta: [N, H]."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(dim=-2)
