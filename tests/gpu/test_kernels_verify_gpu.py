"""Verify rows (speculative decoding) on CUDA: the Triton conv1d and gated delta rule against the torch
references at the Qwen3.5-4B GDN shape and a small one, in bf16 and fp32, for verify rows of 2..5 tokens
in batches with decode rows and prefill chunks (fla), every state slot compared, the per-token
state_after slots included; CUDA-graph capture and replay of decode + verify batches, for the two ops
and for the whole (tiny) model, whose verify-row logits must equal sequential decode steps.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from deltaserve.cache.device import build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import init_dummy_weights
from deltaserve.ops import conv1d, gdn
from deltaserve.ops.batch import BatchRow, ForwardBatch, build_forward_batch
from deltaserve.ops.triton import conv1d as triton_conv
from deltaserve.ops.triton import gdn as triton_gdn
from deltaserve.tiny import official_config

DEV = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]
K = 4  # conv width
PAGE = 16
# (key heads, value heads, head dim, conv channels): Qwen3.5-4B (conv_dim 2*16*128 + 32*128 = 8192), small.
SHAPES = {"4B": (16, 32, 128, 8192), "small": (2, 4, 32, 300)}
GDN_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# fla's chunked kernel against the token-by-token reference: loose, enough to catch a misplaced row.
FLA_TOL = dict(rtol=3e-2, atol=3e-2)


def verify_batch_rows(
    decodes: int, verify_lengths: list[int], prefills: list[tuple[int, int]], seed: int
) -> list[BatchRow]:
    """Decode rows, verify rows of the given lengths, prefill chunks (tokens, context); every slot
    distinct, drawn from 1.. (slot 0 is the reserved one), contexts random."""
    gen = torch.Generator().manual_seed(seed)
    slots = itertools.count(1)

    def ctx() -> int:
        return int(torch.randint(1, 300, (1,), generator=gen))

    def row(n: int, context: int, after: tuple[int, ...] = ()) -> BatchRow:
        pages = list(range(-(-(context + n) // PAGE)))
        return BatchRow([0] * n, context, pages, next(slots), state_after=after)

    rows = [row(1, ctx()) for _ in range(decodes)]
    rows += [row(t, ctx(), tuple(next(slots) for _ in range(t - 1))) for t in verify_lengths]
    rows += [row(n, context) for n, context in prefills]
    return rows


def num_slots(rows: list[BatchRow]) -> int:
    return 2 + max(max(r.state_slot, *r.state_after) if r.state_after else r.state_slot for r in rows)


def stale_slots(rows: list[BatchRow]) -> list[int]:
    """Slots whose old contents must never be read: state_after targets and context-0 rows' slots."""
    return sorted(
        {s for r in rows for s in r.state_after} | {r.state_slot for r in rows if r.context_len == 0}
    )


def assert_pools_equal(got: torch.Tensor, want: torch.Tensor, **tol: float) -> None:
    assert torch.equal(got.isnan(), want.isnan()), "a slot was (not) written where the reference (not) wrote"
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), **tol)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 ulp everywhere and identical in >= 99% (as the conv kernels' other tests)."""
    bits = [t.view(torch.int16).to(torch.int32) for t in (got, want)]
    line = [torch.where(b < 0, -(b & 0x7FFF), b) for b in bits]
    ulps = (line[0] - line[1]).abs()
    assert ulps.max().item() <= 1, f"max {ulps.max().item()} bf16 ulps from the reference"
    assert (ulps == 0).float().mean().item() >= 0.99


# ---- conv1d ------------------------------------------------------------------------------------------


def check_conv(rows: list[BatchRow], channels: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    batch = build_forward_batch(rows, PAGE, DEV)
    proj = torch.randn(batch.num_tokens, channels + 64, generator=gen, device=DEV).to(dtype)
    x = proj[:, 16 : 16 + channels]  # strided, as the in_proj output's qkv part
    weight = (0.5 * torch.randn(channels, K, generator=gen, device=DEV)).to(dtype)
    pool = torch.randn(num_slots(rows), channels, K - 1, generator=gen, device=DEV).to(dtype)
    pool[stale_slots(rows)] = float("nan")
    want_pool = pool.clone()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        want = conv1d.causal_conv1d(x, weight, want_pool, batch)
    out = torch.full((batch.num_tokens, channels), float("nan"), dtype=dtype, device=DEV)
    got = triton_conv.causal_conv1d(x, weight, pool, batch, out=out)
    assert torch.isfinite(got).all(), "a conv output was left unwritten"
    if dtype == torch.bfloat16:
        assert_bf16_close(got, want)
        assert torch.equal(pool.isnan(), want_pool.isnan())
        assert torch.equal(pool.nan_to_num(), want_pool.nan_to_num())  # windows are copies: exact
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert_pools_equal(pool, want_pool, rtol=0, atol=0)


BATCHES = {
    # (decode rows, verify row lengths, prefill chunks as (tokens, context))
    "verify_only": (0, [2, 3, 4, 5] * 4, []),
    "decode_and_verify": (24, [4, 2, 5, 3, 4, 4, 2], []),
    "mixed": (9, [5, 4, 3, 2, 5], [(70, 0), (33, 12), (1, 0), (2, 7)]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch_kind", list(BATCHES))
def test_conv_verify_rows_match_reference(dtype, shape, batch_kind):
    decodes, lengths, prefills = BATCHES[batch_kind]
    rows = verify_batch_rows(decodes, lengths, prefills, seed=len(batch_kind))
    check_conv(rows, SHAPES[shape][3], dtype, seed=len(shape))


# ---- gated delta rule --------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class GdnInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias


def gdn_inputs(tokens: int, shape: str, dtype: torch.dtype, gen: torch.Generator) -> GdnInputs:
    """q, k, v as strided views of one conv output row, a, b of one projection row (as the layer)."""
    hk, hv, d, _ = SHAPES[shape]
    mixed = torch.randn(tokens, (2 * hk + hv) * d, generator=gen, device=DEV).to(dtype)
    q, k, v = mixed.split([hk * d, hk * d, hv * d], dim=-1)
    ba = torch.randn(tokens, 2 * hv, generator=gen, device=DEV).to(dtype)
    return GdnInputs(
        q.view(tokens, hk, d),
        k.view(tokens, hk, d),
        v.view(tokens, hv, d),
        ba[:, hv:],
        ba[:, :hv],
        torch.rand(hv, generator=gen, device=DEV) * 2,
        torch.randn(hv, generator=gen, device=DEV) * 0.5 + 1,
    )


def gdn_pool(rows: list[BatchRow], shape: str, gen: torch.Generator) -> torch.Tensor:
    _, hv, d, _ = SHAPES[shape]
    pool = 0.3 * torch.randn(num_slots(rows), hv, d, d, generator=gen, device=DEV)
    pool[stale_slots(rows)] = float("nan")
    return pool


def prefill_tokens(batch: ForwardBatch) -> slice:
    return slice(sum(batch.query_lens_host[: batch.num_decodes + batch.num_verify]), batch.num_tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch_kind", list(BATCHES))
def test_gdn_verify_rows_match_reference(dtype, shape, batch_kind):
    decodes, lengths, prefills = BATCHES[batch_kind]
    rows = verify_batch_rows(decodes, lengths, prefills, seed=len(batch_kind))
    batch = build_forward_batch(rows, PAGE, DEV)
    gen = torch.Generator(device=DEV).manual_seed(len(shape) + len(batch_kind))
    inputs = gdn_inputs(batch.num_tokens, shape, dtype, gen)
    pool = gdn_pool(rows, shape, gen)
    want_pool = pool.clone()
    want = gdn.gated_delta_rule(*inputs.args(), want_pool, batch)
    got = triton_gdn.gated_delta_rule(*inputs.args(), pool, batch)
    tol = GDN_TOL[dtype]
    fast = slice(0, prefill_tokens(batch).start)  # decode and verify rows: the Triton kernels
    torch.testing.assert_close(got[fast].float(), want[fast].float(), **tol)
    torch.testing.assert_close(
        got[prefill_tokens(batch)].float(), want[prefill_tokens(batch)].float(), **FLA_TOL
    )
    fla_slots = [r.state_slot for r in rows[batch.num_decodes + batch.num_verify :]]
    other = sorted(set(range(pool.shape[0])) - set(fla_slots))
    assert_pools_equal(pool[other], want_pool[other], **tol)
    assert_pools_equal(pool[fla_slots], want_pool[fla_slots], **FLA_TOL)
    assert not pool[[s for r in rows for s in r.state_after]].isnan().any()


# ---- CUDA graphs -------------------------------------------------------------------------------------


def copy_gdn_inputs(dst: ForwardBatch, src: ForwardBatch) -> None:
    """What the conv and GDN kernels read of a batch, from a batch of the same row kinds and token
    count into a captured batch's device tensors."""
    for name in ("query_start_loc", "context_lens", "state_slots", "verify_state_slots"):
        getattr(dst, name).copy_(getattr(src, name))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_verify_ops_replayed_from_a_cuda_graph_follow_new_rows_and_slots(dtype):
    """Capture conv + gated delta rule on one decode + verify batch at the 4B shape; replay with new
    activations, pool contents, slots, contexts and per-row token counts (same totals): every replay
    must match the references on its batch."""
    hk, hv, d, channels = SHAPES["4B"]
    gen = torch.Generator(device=DEV).manual_seed(5)
    layouts = [[4, 2, 5, 3, 4, 2], [2, 5, 5, 2, 3, 3], [3, 3, 4, 4, 2, 4]]  # 20 verify tokens each
    rows = [verify_batch_rows(5, lengths, [], seed=i) for i, lengths in enumerate(layouts)]
    batches = [build_forward_batch(r, PAGE, DEV) for r in rows]
    static = batches[0]
    tokens = static.num_tokens
    conv_in = torch.zeros(tokens, channels + 64, dtype=dtype, device=DEV)
    x = conv_in[:, :channels]
    weight = (0.5 * torch.randn(channels, K, generator=gen, device=DEV)).to(dtype)
    inputs = gdn_inputs(tokens, "4B", dtype, gen)
    slots = max(num_slots(r) for r in rows)
    conv_pool = torch.zeros(slots, channels, K - 1, dtype=dtype, device=DEV)
    ssm_pool = torch.zeros(slots, hv, d, d, device=DEV)
    conv_out = torch.empty(tokens, channels, dtype=dtype, device=DEV)
    gdn_out = torch.empty(tokens, hv, d, dtype=dtype, device=DEV)

    def step() -> None:
        triton_conv.causal_conv1d(x, weight, conv_pool, static, out=conv_out)
        gdn_out.copy_(triton_gdn.gated_delta_rule(*inputs.args(), ssm_pool, static))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for batch in reversed(batches):
        copy_gdn_inputs(static, batch)
        conv_in.copy_(torch.randn(conv_in.shape, generator=gen, device=DEV).to(dtype))
        fresh = gdn_inputs(tokens, "4B", dtype, gen)
        for name in ("q", "k", "v", "a", "b"):
            getattr(inputs, name).copy_(getattr(fresh, name))
        conv_pool.copy_(torch.randn(conv_pool.shape, generator=gen, device=DEV).to(dtype))
        ssm_pool.copy_(0.3 * torch.randn(ssm_pool.shape, generator=gen, device=DEV))
        want_conv_pool, want_ssm_pool = conv_pool.clone(), ssm_pool.clone()
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            want_conv = conv1d.causal_conv1d(x, weight, want_conv_pool, batch)
        want_gdn = gdn.gated_delta_rule(*inputs.args(), want_ssm_pool, batch)
        conv_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if dtype == torch.bfloat16:
            assert_bf16_close(conv_out, want_conv)
        else:
            torch.testing.assert_close(conv_out, want_conv, rtol=1e-5, atol=1e-5)
        assert torch.equal(conv_pool, want_conv_pool)
        torch.testing.assert_close(gdn_out.float(), want_gdn.float(), **GDN_TOL[dtype])
        torch.testing.assert_close(ssm_pool, want_ssm_pool, **GDN_TOL[dtype])


# ---- the whole model ---------------------------------------------------------------------------------


def tiny_model() -> Qwen35ForCausalLM:
    cfg = dataclasses.replace(ModelConfig.from_dict(official_config("tiny")), vocab_size=512)
    model = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=DEV)
    init_dummy_weights(model, seed=3)
    return model


def test_model_verify_rows_equal_decode_steps_and_replay_from_a_cuda_graph():
    """fp32 tiny model on the kernels: a batch of one decode row and two verify rows (4 and 3 tokens)
    gives the logits and GDN states of sequential decode steps; the same batch captured in a CUDA graph
    and replayed with other draft tokens gives what eager runs give for them."""
    model = tiny_model()
    caches = build_device_caches(
        model.local_config, num_pages=64, page_size=PAGE, num_slots=16, dtype=torch.float32, device=DEV
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (30, 17, 41)]
    pages = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    own, after = [1, 2, 3], [(10, 11, 12), (13, 14)]

    def forward(rows: list[BatchRow]) -> torch.Tensor:
        with torch.inference_mode():
            batch = build_forward_batch(rows, PAGE, DEV)
            return model.compute_logits(model(batch, caches.kv, caches.states))

    def step_rows(drafts: list[list[int]]) -> list[BatchRow]:
        return [
            BatchRow(drafts[0], len(prompts[0]), pages[0], own[0]),
            BatchRow(drafts[1], len(prompts[1]), pages[1], own[1], state_after=after[0]),
            BatchRow(drafts[2], len(prompts[2]), pages[2], own[2], state_after=after[1]),
        ]

    forward([BatchRow(p, 0, pages[i], own[i]) for i, p in enumerate(prompts)])  # prefill (fla)
    pools = (caches.kv.k, caches.kv.v, caches.states.conv, caches.states.ssm)
    start = [p.clone() for p in pools]

    def restore() -> None:
        for p, s in zip(pools, start, strict=True):
            p.copy_(s)

    def draws() -> list[list[int]]:
        return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 4, 3)]

    drafts = draws()
    got = forward(step_rows(drafts))
    got_conv, got_ssm = caches.states.conv.clone(), caches.states.ssm.clone()
    restore()
    tol = dict(rtol=1e-4, atol=1e-4)
    row = 0
    for i, tokens in enumerate(drafts):
        for t, token in enumerate(tokens):
            want = forward([BatchRow([token], len(prompts[i]) + t, pages[i], own[i])])
            torch.testing.assert_close(got[row], want[0], **tol, msg=f"sequence {i} token {t}")
            row += 1
            target = after[i - 1][t] if i > 0 and t < len(tokens) - 1 else own[i]
            torch.testing.assert_close(got_conv[:, target], caches.states.conv[:, own[i]], **tol)
            torch.testing.assert_close(got_ssm[:, target], caches.states.ssm[:, own[i]], **tol)

    # The same step in a CUDA graph, replayed with other drafts.
    restore()
    static = build_forward_batch(step_rows(drafts), PAGE, DEV)  # not inference tensors: refilled below
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.compute_logits(model(static, caches.kv, caches.states))  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.compute_logits(model(static, caches.kv, caches.states))
    for _ in range(2):
        drafts = draws()
        restore()
        want = forward(step_rows(drafts))
        want_conv, want_ssm = caches.states.conv.clone(), caches.states.ssm.clone()
        restore()
        static.input_ids.copy_(torch.tensor(sum(drafts, []), device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches.states.conv, want_conv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches.states.ssm, want_ssm, rtol=1e-5, atol=1e-5)
