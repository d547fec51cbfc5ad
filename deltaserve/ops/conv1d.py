"""Causal depthwise conv1d over varlen sequences with a per-sequence conv state (torch reference).

The conv state of a sequence is its last K-1 pre-conv inputs, [channels, K-1], in the model dtype. A
sequence with context 0 starts from a zero window (its slot's old contents are ignored); otherwise the
window continues from the slot. After the step the slot holds the last K-1 inputs of the sequence. A
verify row (ForwardBatch.num_verify) also leaves the window ending at each of its tokens t, in slot
verify_state_slots[t] (the last one is the row's own slot). An empty sequence (no new tokens: graph
padding) reads and writes nothing.
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
    verify_rows = range(batch.num_decodes, batch.num_decodes + batch.num_verify)
    start = 0
    verified = 0  # tokens of the verify rows so far: the index into verify_state_slots
    for i, (n, ctx) in enumerate(zip(batch.query_lens_host, batch.context_lens_host, strict=True)):
        if n == 0:
            continue
        slot = batch.state_slots[i]
        if ctx > 0:
            window = conv_state[slot].to(x.dtype)
        else:
            window = x.new_zeros(x.shape[1], width)
        # A copy: the slot may be overwritten below while seq is still read.
        seq = torch.cat((window, x[start : start + n].t()), dim=1)  # [C, K-1+n]
        y = F.conv1d(seq.float()[None], w[:, None, :], groups=seq.shape[0])[0]  # [C, n]
        out[start : start + n] = F.silu(y.t().to(x.dtype))
        if i in verify_rows:
            # The window ending at token t is seq[:, t+1 : t+1+K-1]; the last one goes to the row's slot.
            windows = seq.unfold(1, width, 1)[:, 1:]  # [C, n, K-1]
            slots = batch.verify_state_slots[verified : verified + n]
            conv_state[slots] = windows.transpose(0, 1).to(conv_state.dtype)
            verified += n
        else:
            conv_state[slot] = seq[:, -width:].to(conv_state.dtype)
        start += n
    return out
