"""conv1d, RMSNorm and SwiGLU kernels at Qwen3.5-4B shapes on CUDA in bf16, against the torch references
run on the same GPU; a CUDA-graph capture and replay of the decode conv; and `bench_conv_norm()`, which
prints achieved bandwidth (`python tests/gpu/test_kernels_conv_norm_gpu.py`).

bf16 results must be within one bf16 ulp of the reference and identical in >= 99% of the elements
(only a different fp32 summation order can move a value across a rounding boundary); SwiGLU has no
reduction and uses torch's own expf and IEEE division, so it must be bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from deltaserve.ops import activation, conv1d, norm
from deltaserve.ops.batch import BatchRow, ForwardBatch, build_forward_batch
from deltaserve.ops.triton import activation as triton_act
from deltaserve.ops.triton import conv1d as triton_conv
from deltaserve.ops.triton import norm as triton_norm

DEV = torch.device("cuda")
BF16 = torch.bfloat16
EPS = 1e-6
# Qwen3.5-4B: hidden 2560; GDN 16 key heads and 32 value heads of 128 (conv_dim 2*16*128 + 32*128 = 8192);
# full attention 16 q heads and 4 kv heads of 256; MLP intermediate 9216; conv width 4.
HIDDEN, CONV_DIM, V_HEADS, HEAD_V, INTER, K = 2560, 8192, 32, 128, 9216, 4
IN_PROJ = CONV_DIM + V_HEADS * HEAD_V + 2 * V_HEADS  # qkv | z | b | a


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = BF16) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def poisoned(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=BF16, device=DEV)


def assert_matches(got: torch.Tensor, want: torch.Tensor, max_ulps: int = 1) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == BF16
    assert torch.isfinite(got).all(), "the kernel left poisoned (NaN) or non-finite values"
    bits = [t.view(torch.int16).to(torch.int32) for t in (got, want)]
    line = [torch.where(b < 0, -(b & 0x7FFF), b) for b in bits]  # bf16 bit patterns on a monotone line
    ulps = (line[0] - line[1]).abs()
    assert ulps.max().item() <= max_ulps, f"max {ulps.max().item()} bf16 ulps from the reference"
    identical = (ulps == 0).float().mean().item()
    assert identical >= 0.99, f"only {identical:.2%} of the values are identical to the reference"


def make_batch(rows: list[tuple[int, int, int]]) -> ForwardBatch:
    """rows: (new tokens, context, state slot) per sequence, decode rows first."""
    return build_forward_batch(
        [BatchRow([0] * n, ctx, list(range((ctx + n + 15) // 16)), slot) for n, ctx, slot in rows],
        page_size=16,
        device=DEV,
    )


def check_conv(rows: list[tuple[int, int, int]], seed: int, slots: int = 320) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(rows)
    x = randn(gen, batch.num_tokens, IN_PROJ)[:, :CONV_DIM]  # the qkv part of the in_proj output
    weight = randn(gen, CONV_DIM, K, scale=0.5)
    state = randn(gen, slots, CONV_DIM, K - 1)
    state[[slot for _, ctx, slot in rows if ctx == 0]] = float("nan")  # stale: must never be read
    want_state = state.clone()
    want = conv1d.causal_conv1d(x, weight, want_state, batch)
    got = triton_conv.causal_conv1d(x, weight, state, batch, out=poisoned(batch.num_tokens, CONV_DIM))
    assert_matches(got, want)
    assert torch.equal(state.isnan(), want_state.isnan())
    assert torch.equal(state.nan_to_num(), want_state.nan_to_num())


@pytest.mark.parametrize("batch_size", [1, 2, 7, 64, 255, 256])
def test_conv_decode_at_4b_shape(batch_size):
    gen = torch.Generator().manual_seed(batch_size)
    slots = (torch.randperm(319, generator=gen)[:batch_size] + 1).tolist()
    check_conv([(1, 1 + i % 50, slot) for i, slot in enumerate(slots)], seed=batch_size)


def test_conv_prefill_4096_tokens_from_a_stale_slot():
    check_conv([(4096, 0, 7)], seed=11)


def test_conv_mixed_batch_at_4b_shape():
    decodes = [(1, 3 + i, 100 + i) for i in range(32)]
    prefills = [(4096, 1000, 5), (1, 0, 6), (2, 0, 9), (3, 5, 10), (2, 8, 12), (700, 0, 13), (37, 64, 14)]
    check_conv(decodes + prefills, seed=12)


def test_conv_decode_cuda_graph_replay_follows_new_inputs_and_slots():
    # Capture once; each replay gets new x, slots, context lengths and pool contents through the
    # captured buffers, and must match an eager reference. Decode rows always have context (a one-token
    # row at context 0 is a prefill row and never reaches a decode graph); a slot outside the batch
    # holds NaN and must stay unread and unwritten.
    gen = torch.Generator().manual_seed(20)
    b, pool_slots = 8, 64
    proj = torch.zeros(b, IN_PROJ, dtype=BF16, device=DEV)
    x = proj[:, :CONV_DIM]
    weight = randn(gen, CONV_DIM, K, scale=0.5)
    pool = randn(gen, pool_slots, CONV_DIM, K - 1)
    batch = make_batch([(1, 5, slot) for slot in range(1, b + 1)])
    out = torch.empty(b, CONV_DIM, dtype=BF16, device=DEV)
    triton_conv.causal_conv1d(x, weight, pool, batch, out=out)  # compiles before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_conv.causal_conv1d(x, weight, pool, batch, out=out)

    for step in range(3):
        slots = (torch.randperm(pool_slots - 1, generator=gen)[: b + 1] + 1).tolist()
        slots, unused = slots[:b], slots[b]
        ctx = [1 + step + 3 * i for i in range(b)]
        proj.copy_(randn(gen, b, IN_PROJ))
        pool.copy_(randn(gen, pool_slots, CONV_DIM, K - 1))
        pool[unused] = float("nan")
        batch.state_slots.copy_(torch.tensor(slots, dtype=torch.int64))
        batch.context_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        want_pool = pool.clone()
        want = conv1d.causal_conv1d(
            x, weight, want_pool, make_batch(list(zip([1] * b, ctx, slots, strict=True)))
        )
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, want)
        assert torch.equal(pool.isnan(), want_pool.isnan())
        assert torch.equal(pool.nan_to_num(), want_pool.nan_to_num())


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_rms_norm_hidden_with_residual_at_4b_shape(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = randn(gen, tokens, HIDDEN), randn(gen, tokens, HIDDEN, scale=8.0)
    weight = randn(gen, HIDDEN, scale=0.1)
    got, got_res = triton_norm.rms_norm(
        x, weight, EPS, residual, out=poisoned(tokens, HIDDEN), residual_out=poisoned(tokens, HIDDEN)
    )
    want, want_res = norm.rms_norm(x, weight, EPS, residual)
    assert torch.equal(got_res, want_res)
    assert_matches(got, want)
    assert_matches(
        triton_norm.rms_norm(x, weight, EPS, out=poisoned(tokens, HIDDEN)), norm.rms_norm(x, weight, EPS)
    )


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_rms_norm_q_and_k_heads_at_4b_shape(tokens):
    # q: first half of each head of the interleaved q|gate projection; k: a view of the qkv output.
    gen = torch.Generator().manual_seed(100 + tokens)
    qkv = randn(gen, tokens, 16 * 512 + 2 * 4 * 256)
    q = qkv[:, : 16 * 512].view(tokens, 16, 512)[..., :256]
    k = qkv[:, 16 * 512 : 16 * 512 + 4 * 256].view(tokens, 4, 256)
    weight = randn(gen, 256, scale=0.1)
    assert_matches(
        triton_norm.rms_norm(q, weight, EPS, out=poisoned(tokens, 16, 256)), norm.rms_norm(q, weight, EPS)
    )
    assert_matches(
        triton_norm.rms_norm(k, weight, EPS, out=poisoned(tokens, 4, 256)), norm.rms_norm(k, weight, EPS)
    )


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_gated_rms_norm_at_4b_shape(tokens):
    gen = torch.Generator().manual_seed(200 + tokens)
    x = randn(gen, tokens, V_HEADS, HEAD_V)
    proj = randn(gen, tokens, IN_PROJ)
    z = proj[:, CONV_DIM : CONV_DIM + V_HEADS * HEAD_V].reshape(tokens, V_HEADS, HEAD_V)
    weight = randn(gen, HEAD_V, scale=0.5) + 1.0
    got = triton_norm.gated_rms_norm(x, z, weight, EPS, out=poisoned(tokens, V_HEADS, HEAD_V))
    # two roundings (normed, then times the weight) before the gate: one ulp in the first can become two
    assert_matches(got, norm.gated_rms_norm(x, z, weight, EPS), max_ulps=2)


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_silu_and_mul_is_bit_identical_at_4b_shape(tokens):
    gen = torch.Generator().manual_seed(300 + tokens)
    gate_up = randn(gen, tokens, 2 * INTER, scale=3.0)
    got = triton_act.silu_and_mul(gate_up, out=poisoned(tokens, INTER))
    assert torch.equal(got, activation.silu_and_mul(gate_up))


def bench_conv_norm() -> None:
    """Prints time and achieved DRAM bandwidth (bytes that must move / median time, L2 flushed between
    runs by do_bench) of each kernel at Qwen3.5-4B shapes in bf16. Not a test."""
    import triton.testing

    gen = torch.Generator().manual_seed(0)
    e = 2  # bytes per bf16 value

    def report(name: str, fn: Callable[[], object], nbytes: int) -> None:
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"{name:<44} {ms * 1e3:9.1f} us {nbytes / ms / 1e6:8.0f} GB/s")

    weight = randn(gen, CONV_DIM, K, scale=0.5)
    pool = randn(gen, 1024, CONV_DIM, K - 1)
    decodes = [
        [(1, 9, slot) for slot in (torch.randperm(1023, generator=gen)[:b] + 1).tolist()]
        for b in (1, 32, 256)
    ]
    prefills = [[(4096, 0, 1)], [(1, 9, 2 + i) for i in range(64)] + [(4096, 512, 1)]]
    for rows in decodes + prefills:
        batch = make_batch(rows)
        t = batch.num_tokens
        x = randn(gen, t, IN_PROJ)[:, :CONV_DIM]
        out = torch.empty(t, CONV_DIM, dtype=BF16, device=DEV)
        nbytes = (
            2 * t * CONV_DIM + 2 * len(rows) * CONV_DIM * (K - 1) + CONV_DIM * K
        ) * e  # x, out, slots, w
        fn = partial(triton_conv.causal_conv1d, x, weight, pool, batch, out=out)
        report(f"conv1d {len(rows)} seqs, {t} tokens", fn, nbytes)

    w_hidden = randn(gen, HIDDEN, scale=0.1)
    w_head = randn(gen, HEAD_V, scale=0.5) + 1.0
    for t in (1, 256, 4096):
        x, res = randn(gen, t, HIDDEN), randn(gen, t, HIDDEN)
        fn = partial(
            triton_norm.rms_norm,
            x,
            w_hidden,
            EPS,
            res,
            out=torch.empty_like(x),
            residual_out=torch.empty_like(x),
        )
        report(f"rms_norm + residual T={t} N={HIDDEN}", fn, 4 * t * HIDDEN * e)
        g, proj = randn(gen, t, V_HEADS, HEAD_V), randn(gen, t, IN_PROJ)
        z = proj[:, CONV_DIM : CONV_DIM + V_HEADS * HEAD_V].reshape(t, V_HEADS, HEAD_V)
        fn = partial(triton_norm.gated_rms_norm, g, z, w_head, EPS, out=torch.empty_like(g))
        report(f"gated_rms_norm T={t} {V_HEADS}x{HEAD_V}", fn, 3 * t * V_HEADS * HEAD_V * e)
        gate_up = randn(gen, t, 2 * INTER)
        fn = partial(triton_act.silu_and_mul, gate_up, out=torch.empty(t, INTER, dtype=BF16, device=DEV))
        report(f"silu_and_mul T={t} I={INTER}", fn, 3 * t * INTER * e)


if __name__ == "__main__":
    bench_conv_norm()
