"""Causal depthwise conv1d over varlen sequences with a per-sequence conv state (torch reference).

The conv state of a sequence is its last K-1 pre-conv inputs, [channels, K-1], in the model dtype. A
sequence with context 0 starts from a zero window (its slot's old contents are ignored); otherwise the
window continues from the slot. After the step the slot holds the last K-1 inputs of the sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.batch import ForwardBatch


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    """x: [T, C]; weight: [C, K]; conv_state: [slots, C, K-1] (updated in place). Returns silu(conv(x))
    [T, C] in x's dtype; the conv sum is rounded to x's dtype before the SiLU, as HF does."""
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    w = weight.float()
    start = 0
    for i, (n, ctx) in enumerate(zip(batch.query_lens_host, batch.context_lens_host, strict=True)):
        slot = batch.state_slots[i]
        if ctx > 0:
            window = conv_state[slot].to(x.dtype)
        else:
            window = x.new_zeros(x.shape[1], width)
        seq = torch.cat((window, x[start : start + n].t()), dim=1)  # [C, K-1+n]
        y = F.conv1d(seq.float()[None], w[:, None, :], groups=seq.shape[0])[0]  # [C, n]
        out[start : start + n] = F.silu(y.t().to(x.dtype))
        conv_state[slot] = seq[:, -width:].to(conv_state.dtype)
        start += n
    return out
