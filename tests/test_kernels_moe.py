"""The fused-MoE Triton kernels against the torch reference (deltaserve/ops/moe.py), in Triton's CPU
interpreter without CUDA and natively with it. Outputs are passed poisoned with NaN and the kernels'
workspaces are allocated NaN-filled, so a row the kernels fail to write (or read before it is written)
cannot pass.

bf16 results with k <= 2 must be identical to the reference almost everywhere: the kernels round where
the reference rounds, and summing two rounded values in fp32 and rounding once is what its two adds do.
With k > 2 the reference rounds after each add, the kernels once; there they must equal a reference
that sums in fp32, and stay within bf16 tolerance of the reference itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops import moe
from deltaserve.ops.activation import silu_and_mul

tri = pytest.importorskip("deltaserve.ops.triton.moe")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
E, H, INTER = 8, 48, 40  # neither H nor INTER is a multiple of the 64-wide tiles (32-wide K for fp32)

_torch_empty = torch.empty


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.fixture(autouse=True)
def nan_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float tensors from torch.empty (the kernels' workspaces) start as NaN instead of stale memory."""

    def empty(*args, **kwargs) -> torch.Tensor:
        t = _torch_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def make_inputs(
    tokens: int,
    top_k: int,
    dtype: torch.dtype,
    seed: int,
    logits: torch.Tensor | None = None,
    inter: int = INTER,
):
    """x as a strided view of a wider row; weights scaled so every stage stays O(1); routing from
    `route` on random logits unless given."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H + 16, generator=gen).to(dtype).to(DEVICE)[:, 8 : 8 + H]
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(dtype).to(DEVICE)
    if logits is None:
        logits = torch.randn(tokens, E, generator=gen)
    weights, ids = moe.route(logits.to(dtype).to(DEVICE), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def reference_summed_in_fp32(x, w13, w2, weights, ids) -> torch.Tensor:
    """The reference with its per-expert adds done in fp32 and rounded once at the end."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        token_idx, k_idx = torch.where(ids == expert)
        h = silu_and_mul(F.linear(x[token_idx], w13[expert]))
        h = F.linear(h, w2[expert]) * weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, h.float())
    return out.to(x.dtype)


def run_kernels(x, w13, w2, weights, ids) -> torch.Tensor:
    out = poisoned(*x.shape, dtype=x.dtype)
    got = tri.fused_experts(x, w13, w2, weights, ids, out=out)
    assert got is out
    return got


def assert_matches(got: torch.Tensor, want: torch.Tensor, identical_share: float = 0.95) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "the kernels left poisoned (NaN) or non-finite values"
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        identical = (got == want).float().mean().item()
        assert identical >= identical_share, f"only {identical:.2%} of the values equal the reference"
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "top_k"),
    # 80 x 2 >= 16 * E: 64-row blocks; 520 x 2 >= 128 * E: 128 x 128 tiles (16-bit)
    [(1, 1), (1, 2), (3, 1), (3, 2), (37, 1), (37, 2), (80, 2), (520, 2)],
)
def test_matches_reference(dtype: torch.dtype, tokens: int, top_k: int) -> None:
    inputs = make_inputs(tokens, top_k, dtype, seed=100 * tokens + top_k)
    assert_matches(run_kernels(*inputs), moe.fused_experts(*inputs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_than_two_experts_per_token_sum_in_fp32(dtype: torch.dtype) -> None:
    inputs = make_inputs(37, 4, dtype, seed=4)
    got = run_kernels(*inputs)
    assert_matches(got, reference_summed_in_fp32(*inputs))
    torch.testing.assert_close(got, moe.fused_experts(*inputs), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_one_expert_takes_every_token_and_most_experts_none(dtype: torch.dtype, top_k: int) -> None:
    # Expert 5 comes first for every token, then 2 or 6 alternately; experts 0, 1, 3, 4, 7 get nothing.
    tokens = 37
    logits = torch.randn(tokens, E, generator=torch.Generator().manual_seed(5))
    logits[:, 5] += 20.0
    logits[0::2, 2] += 10.0
    logits[1::2, 6] += 10.0
    inputs = make_inputs(tokens, top_k, dtype, seed=top_k, logits=logits)
    ids = inputs[4]
    assert (ids[:, 0] == 5).all() and torch.bincount(ids.flatten().cpu(), minlength=E)[[0, 1, 3, 4, 7]].eq(
        0
    ).all()
    assert_matches(run_kernels(*inputs), moe.fused_experts(*inputs))


def test_default_output_is_allocated() -> None:
    inputs = make_inputs(3, 2, torch.bfloat16, seed=9)
    assert_matches(tri.fused_experts(*inputs), moe.fused_experts(*inputs))


def test_zero_tokens_returns_an_empty_result() -> None:
    x, w13, w2, weights, ids = make_inputs(0, 2, torch.float32, seed=0)
    assert tri.fused_experts(x, w13, w2, weights, ids).shape == (0, H)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("block_m", [16, 64])
def test_grouping_lists_every_slot_once_in_single_expert_blocks(top_k: int, block_m: int) -> None:
    tokens = 37
    _, ids = moe.route(torch.randn(tokens, E, generator=torch.Generator().manual_seed(top_k)), top_k, True)
    ids = ids.to(DEVICE)
    grouping = tri.group_slots(ids, E, block_m)
    num_slots = tokens * top_k
    blocks = tri._max_blocks(num_slots, E, block_m)
    assert grouping.sorted_slots.shape == (blocks * block_m,) and grouping.block_expert.shape == (blocks,)
    slots = grouping.sorted_slots.cpu().long()
    real = slots[slots < num_slots]
    assert torch.equal(real.sort().values, torch.arange(num_slots)), "each slot exactly once"
    assert (slots[slots >= num_slots] == num_slots).all(), "padding holds the sentinel T*k"
    # each block holds one expert's slots, ascending; experts ascending; E only past the used blocks
    block_expert = grouping.block_expert.cpu().long()
    flat_ids = ids.flatten().cpu()
    used = int((block_expert < E).sum())
    assert (block_expert[used:] == E).all() and (block_expert[:used].diff() >= 0).all()
    assert (slots.view(blocks, block_m)[used:] == num_slots).all()
    for b in range(used):
        row = slots[b * block_m : (b + 1) * block_m]
        row = row[row < num_slots]
        assert row.numel() > 0 and (flat_ids[row] == block_expert[b]).all() and (row.diff() > 0).all()


def reference_grouping(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouping in torch ops: a stable argsort by expert, each run padded to whole blocks."""
    flat = ids.reshape(-1).long().cpu()
    num_slots = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    pad_start = (block_end - blocks) * block_m
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(num_slots) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_slots = torch.full((tri._max_blocks(num_slots, num_experts, block_m) * block_m,), num_slots)
    sorted_slots[pad_start[flat[order]] + rank] = order
    block_expert = torch.searchsorted(block_end, torch.arange(sorted_slots.numel() // block_m), right=True)
    return sorted_slots.int(), block_expert.int()


@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts", "block_m", "routing"),
    [
        (1, 1, 8, 16, "random"),  # one slot
        (2, 8, 512, 16, "random"),  # more experts than slots
        (300, 2, 8, 16, "one expert"),  # 600 slots in 5 chunks, all one expert: many blocks per program
        (64, 4, 6, 16, "random"),  # E not a power of two
        (1000, 8, 256, 16, "random"),  # decode-sized, 63 chunks (one partial)
        (513, 8, 256, 64, "random"),
        (700, 8, 256, 128, "skewed"),
    ],
)
def test_grouping_kernels_equal_the_torch_grouping(tokens, top_k, num_experts, block_m, routing, monkeypatch):
    """Every position of the kernels' int32 outputs is written (they start poisoned) and equals the torch
    grouping: the same stable order, blocks and sentinels."""

    def poisoned_empty(*args, **kwargs) -> torch.Tensor:
        t = _torch_empty(*args, **kwargs)
        return t.fill_(-7) if t.dtype == torch.int32 else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    if routing == "one expert":
        ids[:] = 3
    elif routing == "skewed":  # half the slots on expert 5, the rest spread
        ids[: tokens // 2, 0] = 5
    grouping = tri.group_slots(ids.to(DEVICE), num_experts, block_m)
    want_slots, want_experts = reference_grouping(ids, num_experts, block_m)
    assert torch.equal(grouping.sorted_slots.cpu(), want_slots)
    assert torch.equal(grouping.block_expert.cpu(), want_experts)


def test_tiles_follow_shapes_only() -> None:
    # 16-bit, by the rows an expert averages (T*k / E) at 256 experts, 8 per token: up to 16, to 127, 128+
    assert tri.default_tiles(1, 8, 256, torch.bfloat16) == (16, 64, 64, 4, 3)  # decode
    assert tri.default_tiles(512, 8, 256, torch.bfloat16) == (16, 64, 64, 4, 3)  # 4096 slots: 16 each
    assert tri.default_tiles(513, 8, 256, torch.bfloat16) == (64, 64, 64, 4, 3)  # 16.03 each
    assert tri.default_tiles(4095, 8, 256, torch.bfloat16) == (64, 64, 64, 4, 3)
    assert tri.default_tiles(4096, 8, 256, torch.bfloat16) == (128, 128, 64, 8, 3)  # 128 each
    # fp32 (tests): 16-row blocks up to 16 rows per expert, then 64; half the 16-bit reduction step
    assert tri.default_tiles(512, 8, 256, torch.float32) == (16, 64, 32, 4, 3)
    assert tri.default_tiles(513, 8, 256, torch.float32) == (64, 64, 32, 4, 3)
    # decode: at most min(E, T*k) experts are used, so the grid stays small even with many experts
    assert tri._max_blocks(8, 256, 16) == 8


def test_same_shapes_different_routing_use_the_same_launches() -> None:
    """What a replayed CUDA graph relies on: the launches depend on shapes only, the routing is read on
    the device. Two routings of the same shapes (one spread out, one concentrated on two experts) go
    through identical grids and both match the reference."""
    tokens, top_k = 37, 2
    spread = torch.randn(tokens, E, generator=torch.Generator().manual_seed(1))
    concentrated = spread.clone()
    concentrated[:, 3] += 20.0
    concentrated[:, 0] += 10.0
    grids = []
    for logits in (spread, concentrated):
        inputs = make_inputs(tokens, top_k, torch.float32, seed=3, logits=logits)
        grouping = tri.group_slots(inputs[4], E, tri.default_tiles(tokens, top_k, E, torch.float32).block_m)
        grids.append((grouping.sorted_slots.shape, grouping.block_expert.shape))
        assert_matches(run_kernels(*inputs), moe.fused_experts(*inputs))
    assert grids[0] == grids[1]


def run_without_host_reads(monkeypatch: pytest.MonkeyPatch, run, inputs) -> torch.Tensor:
    """The CPU stand-in for CUDA's sync debug mode: every way of reading a tensor's value into Python, and
    the torch ops whose output shape depends on values, raise while `run(*inputs)` runs."""

    def host_read(*args, **kwargs):
        raise AssertionError(f"{run.__name__} read a tensor value on the host")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
            m.setattr(torch.Tensor, name, host_read)
        for name in ("nonzero", "unique", "bincount", "masked_select", "where"):
            m.setattr(torch, name, host_read)
        return run(*inputs)


def test_no_tensor_value_is_read_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(37, 2, torch.bfloat16, seed=6)
    got = run_without_host_reads(monkeypatch, run_kernels, inputs)
    assert_matches(got, moe.fused_experts(*inputs))


def replay_with_new_routing(experts, dtype: torch.dtype, seed: int) -> None:
    """Captures `experts(..., out=out)` in a CUDA graph (no host synchronisation allowed), then replays it
    with new routing written into the captured ids and weights: spread, then every token to expert 4."""
    tokens, top_k = 37, 2
    x, w13, w2, weights, ids = make_inputs(tokens, top_k, dtype, seed=seed)
    out = poisoned(tokens, H, dtype=dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        experts(x, w13, w2, weights, ids, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        with torch.cuda.graph(graph):
            experts(x, w13, w2, weights, ids, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for new_seed, boost in ((seed + 1, None), (seed + 2, 4)):
        logits = torch.randn(tokens, E, generator=torch.Generator().manual_seed(new_seed))
        if boost is not None:
            logits[:, boost] += 20.0  # every token to expert 4
        new_weights, new_ids = moe.route(logits.to(dtype).to(DEVICE), top_k, renormalize=True)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, moe.fused_experts(x, w13, w2, weights, ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_replay_with_new_routing(dtype: torch.dtype) -> None:
    replay_with_new_routing(tri.fused_experts, dtype, seed=11)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "w2": a["w2"][:, :, :-1]}, r"w2 has shape \(8, 48, 39\), expected \(8, 48, 40\)"),
        (
            lambda a: {**a, "w13": a["w13"][:, :-1]},
            r"w13 has shape \(8, 79, 48\), expected \(E, 2 \* I, 48\)",
        ),
        (
            lambda a: {**a, "w13": a["w13"].float()},
            "w13 has dtype torch.float32, expected x's torch.bfloat16",
        ),
        (lambda a: {**a, "weights": a["weights"].float()}, "weights has dtype torch.float32, expected x's"),
        (lambda a: {**a, "ids": a["ids"].float()}, "ids has dtype torch.float32, expected torch.int64"),
        (lambda a: {**a, "ids": a["ids"][:, :1]}, r"ids has shape \(3, 1\), expected weights' \(3, 2\)"),
        (lambda a: {**a, "x": a["x"][None]}, r"x has shape \(1, 3, 48\), expected 2-D"),
        (
            lambda a: {**a, "out": torch.zeros(3, H, dtype=torch.float32)},
            "out must be a contiguous torch.bfloat16",
        ),
    ],
)
def test_bad_inputs_are_rejected_naming_the_argument(change, match: str) -> None:
    x, w13, w2, weights, ids = make_inputs(3, 2, torch.bfloat16, seed=0)
    args = change(dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids))
    with pytest.raises(ValueError, match=match):
        tri.fused_experts(**args)


@pytest.mark.parametrize(
    "tiles",
    [
        tri.MoeTiles(block_m=32, block_n=128, block_k=64, num_warps=8, num_stages=2),
        tri.MoeTiles(block_m=128, block_n=32, block_k=16, num_warps=4, num_stages=4),
        tri.MoeTiles(block_m=256, block_n=32, block_k=32, num_warps=8, num_stages=3),
    ],
)
def test_other_launch_parameters_give_the_same_experts(tiles) -> None:
    # What the block-size sweep (python3 -m deltaserve.bench.moe_kernel) runs: any tiles, same result.
    inputs = make_inputs(80, 2, torch.bfloat16, seed=11)
    out = poisoned(*inputs[0].shape, dtype=inputs[0].dtype)
    assert_matches(tri.fused_experts(*inputs, out=out, tiles=tiles), moe.fused_experts(*inputs))


def test_the_large_tiles_setting_parses_and_names_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "DELTASERVE_MOE_LARGE_TILES"
    assert tri.parse_tiles(name, "256,64,64,8,3") == (256, 64, 64, 8, 3)
    for bad in ("256,64,64,8", "256,64,64,8,3,1", "256,x,64,8,3", ""):
        with pytest.raises(
            ValueError, match=f"{name} must be five integers block_m,block_n,block_k,.*got {bad!r}"
        ):
            tri.parse_tiles(name, bad)
    with pytest.raises(ValueError, match=rf"{name}='256,48,64,8,3': tiles.block_n must be a power of two"):
        tri.parse_tiles(name, "256,48,64,8,3")
    # the setting replaces the large tiles only (from 128 rows per expert)
    monkeypatch.setattr(tri, "_TILES_LARGE", tri.parse_tiles(name, "256,64,64,8,3"))
    assert tri.default_tiles(4096, 8, 256, torch.bfloat16) == (256, 64, 64, 8, 3)
    assert tri.default_tiles(4095, 8, 256, torch.bfloat16) == (64, 64, 64, 4, 3)


def test_the_down_kernel_takes_its_own_launch_parameters() -> None:
    # The split sweep (--split) gives gate_up and down different tiles over one grouping.
    inputs = make_inputs(80, 2, torch.bfloat16, seed=13)
    tiles = tri.MoeTiles(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=3)
    down = tri.MoeTiles(block_m=32, block_n=16, block_k=64, num_warps=2, num_stages=2)
    assert_matches(tri.fused_experts(*inputs, tiles=tiles, down_tiles=down), moe.fused_experts(*inputs))
    with pytest.raises(
        ValueError, match=r"down_tiles.block_m must equal tiles.block_m \(32: one grouping\), got 64"
    ):
        tri.fused_experts(*inputs, tiles=tiles, down_tiles=down._replace(block_m=64))
    with pytest.raises(ValueError, match="tiles.num_warps must be 1, 2, 4, 8 or 16, got 3"):
        tri.fused_experts(*inputs, tiles=tiles, down_tiles=down._replace(num_warps=3))


needs_descriptors = pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] < 9,
    reason="tensor descriptors (TMA) need compute capability 9.0+",
)


@needs_descriptors
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "block_m"),
    # 37 x 2 slots over 8 experts: padded blocks; 520 x 2: several blocks per expert
    [(37, 16), (520, 64)],
)
def test_weights_read_through_descriptors_give_what_pointers_give(dtype, tokens: int, block_m: int) -> None:
    # I = 48 is a multiple of the 16-wide column tiles (a gate tile stays out of the up rows); H = 48 and
    # I leave a K tail in the 32-wide steps, which the descriptors read as zeros as the masks do. The
    # NaN-filled workspace puts NaN in down's padding rows of `inter`, which only their own rows may see.
    inputs = make_inputs(tokens, 2, dtype, seed=tokens + block_m, inter=48)
    tiles = tri.MoeTiles(block_m=block_m, block_n=16, block_k=32, num_warps=4, num_stages=3)
    plain = tri.fused_experts(*inputs, tiles=tiles)
    out = poisoned(*inputs[0].shape, dtype=dtype)
    got = tri.fused_experts(*inputs, out=out, tiles=tiles, descriptors=True)
    assert torch.equal(got, plain)
    assert_matches(got, moe.fused_experts(*inputs))


def test_descriptors_are_refused_naming_what_stops_them() -> None:
    inputs = make_inputs(3, 2, torch.bfloat16, seed=14)  # I = 40, H = 48
    tiles = tri.MoeTiles(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=3)
    with pytest.raises(ValueError, match=r"the expert size \(40\) to be a multiple of tiles.block_n \(16\)"):
        tri.fused_experts(*inputs, tiles=tiles, descriptors=True)
    inputs = make_inputs(3, 2, torch.bfloat16, seed=14, inter=48)
    wide = tiles._replace(block_n=32)
    with pytest.raises(ValueError, match=r"hidden size \(48\) to be a multiple of down_tiles.block_n \(32\)"):
        tri.fused_experts(*inputs, tiles=tiles, down_tiles=wide, descriptors=True)
    x, w13, w2, weights, ids = inputs
    strided = torch.cat([w2, w2], dim=2)[:, :, :48]
    with pytest.raises(ValueError, match=r"descriptors need a contiguous w2, got strides \(4608, 96, 1\)"):
        tri.fused_experts(x, w13, strided, weights, ids, tiles=tiles, descriptors=True)


def test_launch_parameters_are_checked_before_any_launch() -> None:
    inputs = make_inputs(3, 2, torch.bfloat16, seed=12)
    default = tri.default_tiles(3, 2, E, torch.bfloat16)
    for bad, field in (
        (default._replace(block_m=48), "tiles.block_m must be a power of two >= 16"),
        (default._replace(block_k=8), "tiles.block_k must be a power of two >= 16"),
        (default._replace(num_warps=3), "tiles.num_warps must be 1, 2, 4, 8 or 16, got 3"),
        (default._replace(num_stages=0), "tiles.num_stages must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=field):
            tri.fused_experts(*inputs, tiles=bad)


def test_the_block_size_sweep_offers_valid_tiles_and_names_a_bad_argument() -> None:
    import argparse

    from deltaserve.bench import moe_kernel as bench

    for tiles in bench.SWEEP + bench.QUICK:
        tri.check_tiles(tiles)
    for n, k, warps, stages in bench.SPLIT:
        tri.check_tiles(tri.MoeTiles(16, n, k, warps, stages))
    assert bench.SWEEP[:3] == [
        tri.default_tiles(1, 8, 256, torch.bfloat16),
        tri.default_tiles(513, 8, 256, torch.bfloat16),
        tri.default_tiles(4096, 8, 256, torch.bfloat16),
    ]
    assert bench.parse_shape("256,8,2048,512") == bench.SHAPE_35B_A3B
    assert bench.parse_tokens("16,2048") == [16, 2048]
    for parse, bad, message in (
        (bench.parse_shape, "256,8,2048", "expected E,K,H,I"),
        (bench.parse_shape, "4,8,64,64", "8 experts per token exceed the 4 experts"),
        (bench.parse_tokens, "16,x", "expected positive integers"),
        (bench.parse_tokens, "0", "expected positive integers"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(bad)


# The grouped-GEMM path (deltaserve/ops/triton/moe_grouped.py): bf16 only; on the CPU torch's reference
# loop stands in for the CUTLASS kernel.
grouped = pytest.importorskip("deltaserve.ops.triton.moe_grouped")
needs_grouped_gemm = pytest.mark.skipif(
    not grouped.grouped_gemm_supported(torch.empty(0, dtype=torch.bfloat16, device=DEVICE)),
    reason="torch's grouped GEMM needs compute capability 9.0+",
)


def run_grouped(x, w13, w2, weights, ids) -> torch.Tensor:
    out = poisoned(*x.shape, dtype=x.dtype)
    got = grouped.grouped_experts(x, w13, w2, weights, ids, out=out)
    assert got is out
    return got


@needs_grouped_gemm
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (3, 2), (37, 2), (80, 2), (520, 2)])
def test_grouped_gemm_path_matches_reference_and_the_kernels(tokens: int, top_k: int) -> None:
    inputs = make_inputs(tokens, top_k, torch.bfloat16, seed=100 * tokens + top_k + 1)
    got = run_grouped(*inputs)
    assert_matches(got, moe.fused_experts(*inputs))
    assert_matches(got, tri.fused_experts(*inputs), identical_share=0.99)


@needs_grouped_gemm
def test_grouped_gemm_path_sums_more_than_two_experts_in_fp32() -> None:
    inputs = make_inputs(37, 4, torch.bfloat16, seed=41)
    assert_matches(run_grouped(*inputs), reference_summed_in_fp32(*inputs))


@needs_grouped_gemm
def test_grouped_gemm_path_with_one_expert_taking_every_token() -> None:
    logits = torch.randn(37, E, generator=torch.Generator().manual_seed(42))
    logits[:, 3] += 20.0  # expert 3 first for every token; the second choice spreads over the rest
    inputs = make_inputs(37, 2, torch.bfloat16, seed=42, logits=logits)
    assert (inputs[4][:, 0] == 3).all()
    assert_matches(run_grouped(*inputs), moe.fused_experts(*inputs))


@needs_grouped_gemm
def test_grouped_gemm_path_reads_no_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(37, 2, torch.bfloat16, seed=43)
    got = run_without_host_reads(monkeypatch, run_grouped, inputs)
    assert_matches(got, moe.fused_experts(*inputs))


def test_grouped_gemm_path_refuses_other_dtypes_and_checks_inputs() -> None:
    x, w13, w2, weights, ids = make_inputs(3, 2, torch.float32, seed=44)
    with pytest.raises(ValueError, match=r"x is torch.float32 on .*: the grouped GEMM needs torch.bfloat16"):
        grouped.grouped_experts(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"w2 has shape \(8, 48, 39\), expected \(8, 48, 40\)"):
        grouped.grouped_experts(x, w13, w2[:, :, :-1], weights, ids)
    assert not grouped.grouped_gemm_supported(x)


@needs_grouped_gemm
def test_grouped_gemm_path_zero_tokens_and_a_strided_out_refused() -> None:
    x, w13, w2, weights, ids = make_inputs(0, 2, torch.bfloat16, seed=45)
    assert grouped.grouped_experts(x, w13, w2, weights, ids).shape == (0, H)
    x, w13, w2, weights, ids = make_inputs(3, 2, torch.bfloat16, seed=45)
    wide = poisoned(3, 2 * H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be a contiguous .* \(strided\)"):
        grouped.grouped_experts(x, w13, w2, weights, ids, out=wide[:, :H])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_grouped_gemm
def test_grouped_gemm_path_replays_in_a_cuda_graph_with_new_routing() -> None:
    replay_with_new_routing(grouped.grouped_experts, torch.bfloat16, seed=46)


@pytest.mark.parametrize(("tokens", "inter", "want"), [(64, 48, True), (63, 48, False), (64, 40, False)])
def test_the_descriptor_setting_dispatches_by_rows_per_expert_and_fit(
    monkeypatch, tokens, inter, want
) -> None:
    # DELTASERVE_MOE_DESCRIPTORS_FROM=16 over 8 experts with k = 2: from 64 tokens (128 slots, 16 each);
    # at I = 40 the 16-wide column tiles do not divide the expert, so pointers stay.
    import deltaserve.ops as ops

    seen = []
    real = tri.fused_experts

    def spy(*args, descriptors: bool = False, **kwargs):
        seen.append(descriptors)
        return real(*args, descriptors=descriptors, **kwargs)

    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(ops, "MOE_DESCRIPTORS_FROM", 16)
    monkeypatch.setattr(tri, "fused_experts", spy)
    monkeypatch.setattr(tri, "default_tiles", lambda *shapes: tri.MoeTiles(16, 16, 32, 4, 3))
    inputs = make_inputs(tokens, 2, torch.float32, seed=15, inter=inter)
    assert_matches(ops.fused_experts(*inputs), moe.fused_experts(*inputs))
    assert seen == [want]
