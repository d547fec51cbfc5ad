"""Attention for long prefill chunks that start their sequence, through torch's SDPA (cuDNN on CUDA).

A chunk from position 0 attends only to its own keys, causally: dense attention, which cuDNN's kernel runs
at about twice the paged kernel's rate at head dim 256 on an H200 (595 against 297 TFLOP/s at 8,192
tokens; docs/benchmarks/2026-12-04-h200-pdl-power-cudnn.md). Its keys and values are gathered from the
pages the q/k-norm kernel wrote them to.

cuDNN builds an execution plan per shape, so a chunk of n tokens runs padded to `bucket_length(n)`: rows
appended after a causal sequence change no earlier row (row i reads keys 0..i only), so the first n rows
are exact. `warm_plans` builds every bucket's plan at start-up; none is built while serving.

Only sequences after the paged kernel's (`fresh_tail`): eager batches whose trailing sequences are all
fresh and at least MIN_TOKENS long. A CUDA graph's batch never takes this path (its host lists are the
capture's). `DELTASERVE_FRESH_SDPA=1` turns it on; off until an A/B says it pays.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from deltaserve.ops.attention import sequence_kv
from deltaserve.ops.batch import ForwardBatch

ENABLED = os.environ.get("DELTASERVE_FRESH_SDPA", "0") == "1"
MIN_TOKENS = 2048  # shorter chunks stay on the paged kernel (their padding costs more than cuDNN saves)
BUCKET = 512
DTYPES = (torch.bfloat16, torch.float16)  # cuDNN's attention has no fp32 kernel


def applies(dtype: torch.dtype) -> bool:
    """Whether activations of `dtype` take the path (the switch is on and cuDNN has a kernel for them)."""
    return ENABLED and dtype in DTYPES


def bucket_length(tokens: int) -> int:
    """The padded length a chunk of `tokens` runs at: the next multiple of BUCKET."""
    return -(-tokens // BUCKET) * BUCKET


def fresh_tail(batch: ForwardBatch, min_tokens: int = MIN_TOKENS) -> int | None:
    """The first sequence of the batch's trailing run of chunks that start their sequence (context 0) and
    hold at least `min_tokens` tokens; None when the last sequence is not one, or the batch is a graph's."""
    if batch.graph_decodes is not None:
        return None
    first = batch.num_seqs
    while (
        first > batch.num_decodes
        and batch.context_lens_host[first - 1] == 0
        and batch.query_lens_host[first - 1] >= min_tokens
    ):
        first -= 1
    return first if first < batch.num_seqs else None


@contextlib.contextmanager
def _backend(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            yield
    else:
        yield  # the reference SDPA (tests)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [L, heads, D], k and v: [L, kv heads, D] -> [L, heads, D], causal."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def attend_fresh(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    first: int,
    out: torch.Tensor,
) -> None:
    """Writes out's rows of sequences first..num_seqs-1 (each with context 0, its K/V already in its pages)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    start = sum(batch.query_lens_host[:first])
    with _backend(q.device):
        for i in range(first, batch.num_seqs):
            n = batch.query_lens_host[i]
            length = bucket_length(n)
            padded = [
                torch.zeros(length, heads, head_dim, dtype=q.dtype, device=q.device)
                for heads in (q.shape[1], num_kv_heads, num_kv_heads)
            ]
            padded[0][:n] = q[start : start + n]
            padded[1][:n] = sequence_kv(k_cache, batch.block_tables[i], n)
            padded[2][:n] = sequence_kv(v_cache, batch.block_tables[i], n)
            out[start : start + n] = _dense(*padded, scale)[:n]
            start += n


def warm_plans(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int,
) -> int:
    """Runs every bucket from MIN_TOKENS to max_tokens once, so cuDNN builds its plans now; the count."""
    if max_tokens < MIN_TOKENS:
        return 0  # no chunk of a step this size takes the path
    lengths = range(bucket_length(MIN_TOKENS), bucket_length(max_tokens) + 1, BUCKET)
    with _backend(device):
        for length in lengths:
            q = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device)
            kv = torch.zeros(length, num_kv_heads, head_dim, dtype=dtype, device=device)
            _dense(q, kv, kv, head_dim**-0.5)
    return len(lengths)
