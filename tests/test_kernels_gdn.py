"""The GDN decode kernel against the torch reference (Triton's CPU interpreter without CUDA)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.batch import BatchRow, build_forward_batch
from deltaserve.ops.gdn import gated_delta_rule as reference

triton_gdn = pytest.importorskip("deltaserve.ops.triton.gdn")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_inputs(n: int, hk: int, hv: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    # q/k/v as strided views of one projection row, as the layer passes them
    mixed = r(n, 2 * hk * d + hv * d)
    q, k, v = mixed.split([hk * d, hk * d, hv * d], dim=-1)
    ab = r(n, 2 * hv)
    b, a = ab[:, :hv], ab[:, hv:]
    A_log = (torch.rand(hv, generator=gen) * 2).to(DEVICE)
    dt_bias = (torch.randn(hv, generator=gen) * 0.5 + 1).to(DEVICE)
    return q.view(n, hk, d), k.view(n, hk, d), v.view(n, hv, d), a, b, A_log, dt_bias


@pytest.mark.parametrize(("hk", "hv", "d"), [(2, 2, 32), (2, 4, 32), (1, 3, 16), (2, 6, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_reference_and_updates_states_in_place(hk, hv, d, dtype):
    n, slots = 5, 9
    q, k, v, a, b, A_log, dt_bias = make_inputs(n, hk, hv, d, dtype, seed=hk * 100 + hv)
    state = torch.randn(slots, hv, d, d, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    rows = [
        BatchRow([1], context_len=3 + i, pages=[1, 2], state_slot=s) for i, s in enumerate([4, 1, 8, 2, 6])
    ]
    batch = build_forward_batch(rows, page_size=16, device=DEVICE)
    ref_state = state.clone()
    expected = reference(q, k, v, a, b, A_log, dt_bias, ref_state, batch)
    out = torch.full((n, hv, d), float("nan"), dtype=dtype, device=DEVICE)
    got_state = state.clone()
    triton_gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, got_state, batch.state_slots, out)
    # bf16: beta is rounded to bf16 (as HF does); one ulp of it moves the fp32 state by ~0.4%
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    torch.testing.assert_close(got_state, ref_state, **tol)
    untouched = [0, 3, 5, 7]
    assert torch.equal(got_state[untouched], state[untouched])


@pytest.mark.parametrize("count", [0, 3, 5])
@pytest.mark.parametrize("row_programs", [2, 16])
def test_decode_kernel_with_a_device_count_runs_only_the_leading_rows(count, row_programs, monkeypatch):
    # A prefill graph's GDN layers: N rows by shape, the first count of them decode rows by value; with
    # 2 row programs each walks every other row.
    monkeypatch.setattr(triton_gdn, "_COUNTED_ROW_PROGRAMS", row_programs)
    n, hk, hv, d, slots = 5, 2, 4, 32, 9
    q, k, v, a, b, A_log, dt_bias = make_inputs(n, hk, hv, d, torch.float32, seed=11)
    state = torch.randn(slots, hv, d, d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    state_slots = [4, 1, 8, 2, 6]
    rows = [BatchRow([1], context_len=3, pages=[1], state_slot=s) for s in state_slots[:count]]
    out = torch.full((n, hv, d), float("nan"), device=DEVICE)
    got_state = state.clone()
    slots_t = torch.tensor(state_slots, device=DEVICE)
    live = torch.tensor([count], dtype=torch.int32, device=DEVICE)
    triton_gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, got_state, slots_t, out, count=live)
    if count:
        ref_state = state.clone()
        batch = build_forward_batch(rows, page_size=16, device=DEVICE)
        expected = reference(
            q[:count], k[:count], v[:count], a[:count], b[:count], A_log, dt_bias, ref_state, batch
        )
        torch.testing.assert_close(out[:count], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_state, ref_state, rtol=1e-4, atol=1e-5)
    assert bool(out[count:].isnan().all())  # the rows past the count: no output written
    untouched = [s for s in range(slots) if s not in state_slots[:count]]
    assert torch.equal(got_state[untouched], state[untouched])


def test_prefill_index_lists_every_64_token_chunk_once_per_batch():
    # Decode rows first (skipped), then prefills of 130, 64 and 1 tokens: chunks 3 + 1 + 1.
    rows = [BatchRow([1], 5, [1], 1), BatchRow([1], 9, [2], 2)]
    rows += [BatchRow([0] * n, ctx, [3] * 20, slot) for n, ctx, slot in [(130, 0, 3), (64, 7, 4), (1, 0, 5)]]
    batch = build_forward_batch(rows, page_size=16, device=DEVICE)
    index = triton_gdn.prefill_index(batch, first=2)
    assert index.start == 2
    assert index.cu_seqlens_cpu.tolist() == [0, 130, 194, 195]
    assert index.cu_seqlens.tolist() == [0, 130, 194, 195]
    assert index.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]
    assert index.cu_seqlens.device.type == DEVICE.type
    # Every GDN layer of the batch gets the same tensors (fla caches its derived indices by identity).
    assert triton_gdn.prefill_index(batch, first=2) is index


@pytest.mark.parametrize(("hk", "hv", "d"), [(2, 4, 32), (1, 3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_kernel_keeps_the_state_after_every_token(hk, hv, d, dtype):
    # Two decode rows, then verify rows of 2..5 tokens: the decode kernel and the verify kernel. The
    # state_after slots hold NaN until written; the other slots must not change.
    rows = [BatchRow([1], 4, [1], 3), BatchRow([1], 9, [2], 1)]
    verify = [(4, 7, 2, (9, 10, 11)), (2, 3, 5, (12,)), (5, 1, 4, (13, 14, 15, 16)), (3, 30, 6, (17, 18))]
    rows += [BatchRow([0] * n, ctx, [3, 4, 5], slot, state_after=after) for n, ctx, slot, after in verify]
    batch = build_forward_batch(rows, page_size=16, device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = make_inputs(batch.num_tokens, hk, hv, d, dtype, seed=hv * 10 + d)
    state = torch.randn(20, hv, d, d, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    state[9:19] = float("nan")
    ref_state = state.clone()
    expected = reference(q, k, v, a, b, A_log, dt_bias, ref_state, batch)
    got = triton_gdn.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, batch)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    torch.testing.assert_close(state, ref_state, equal_nan=True, **tol)
    assert not state[9:19].isnan().any()
    untouched = [0, 7, 8, 19]
    assert state[untouched].isnan().sum() == 0 and torch.equal(state[untouched], ref_state[untouched])


def test_a_batch_of_prefill_chunks_only_returns_flas_output_without_copying_it(monkeypatch):
    """fla writes o for every row when the batch holds chunks only: the step's output is that tensor,
    not a copy into another (0.74 ms of an 8k-token 4B forward). With a decode row first, fla's rows go
    after the decode kernel's. fla itself runs on CUDA only: here a stand-in returns marked rows."""
    import sys
    import types

    outputs = []

    def chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state, **kwargs):
        outputs.append(torch.arange(v.numel(), dtype=v.dtype, device=v.device).view(v.shape))
        return outputs[-1], torch.zeros_like(initial_state)

    module = types.ModuleType(triton_gdn.FLA_CHUNK_MODULE)
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, triton_gdn.FLA_CHUNK_MODULE, module)
    hk, hv, d = 2, 4, 16
    chunks = [BatchRow([0] * n, ctx, [3, 4], slot) for n, ctx, slot in [(7, 0, 1), (5, 3, 2)]]
    state = torch.zeros(8, hv, d, d, device=DEVICE)

    batch = build_forward_batch(chunks, page_size=16, device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = make_inputs(batch.num_tokens, hk, hv, d, torch.float32, seed=1)
    got = triton_gdn.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, batch)
    (fla_o,) = outputs
    assert fla_o.shape == (1, 12, hv, d) and got.shape == (12, hv, d)
    assert got.data_ptr() == fla_o.data_ptr() and torch.equal(got, fla_o[0])  # fla's own tensor

    with_decode = build_forward_batch([BatchRow([1], 4, [5], 3), *chunks], page_size=16, device=DEVICE)
    q, k, v, a, b, A_log, dt_bias = make_inputs(with_decode.num_tokens, hk, hv, d, torch.float32, seed=2)
    got = triton_gdn.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, with_decode)
    assert len(outputs) == 2 and got.shape == (13, hv, d)
    assert got.data_ptr() != outputs[1].data_ptr() and torch.equal(
        got[1:], outputs[1][0]
    )  # after the decode row


def flush_subnormals(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.abs() < torch.finfo(t.dtype).tiny, torch.zeros_like(t), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hv", [3, 32])
def test_gating_kernel_has_the_reference_values(dtype, hv):
    """g and beta for fla, one launch: bit for bit on CUDA (the same libdevice functions and roundings;
    a subnormal result flushed to zero, where exp(g) is 1 either way), within a few fp32 ulps under the interpreter (numpy's exp and log). a + dt_bias spans both sides of
    softplus's threshold (20) and the far negative side, where log1p(exp(x)) underflows toward 0."""
    from deltaserve.ops.gdn import gdn_gating as reference_gating
    from deltaserve.ops.triton.gdn_gating import gdn_gating

    gen = torch.Generator().manual_seed(hv)
    tokens = 70  # more than one program's rows at hv = 32 (64 rows each), the last program ragged
    ab = (torch.randn(tokens, 2 * hv + 5, generator=gen) * 12).to(dtype).to(DEVICE)
    b, a = ab[:, :hv], ab[:, hv + 5 :]  # strided views, as the layer's in_proj output hands them over
    a[0, 0], a[1, 0] = 40.0, -90.0
    A_log = (torch.rand(hv, generator=gen) * 2).to(DEVICE)
    dt_bias = (torch.randn(hv, generator=gen) * 0.5 + 1).to(DEVICE)
    got_g, got_beta = gdn_gating(a, b, A_log, dt_bias)
    want_g, want_beta = reference_gating(a, b, A_log, dt_bias)
    assert got_g.dtype == torch.float32 and got_beta.dtype == dtype
    assert got_g.shape == got_beta.shape == (tokens, hv) and got_g.is_contiguous()
    if DEVICE.type == "cuda":  # Triton links libdevice's flush-to-zero variants: subnormals come out 0
        assert torch.equal(got_g, flush_subnormals(want_g)) and torch.equal(
            got_beta, flush_subnormals(want_beta)
        )
    else:
        torch.testing.assert_close(got_g, want_g, rtol=4e-6, atol=1e-30)
        torch.testing.assert_close(got_beta.float(), want_beta.float(), rtol=8e-3, atol=0)


def test_gating_kernel_names_a_misshaped_input():
    from deltaserve.ops.triton.gdn_gating import gdn_gating

    a = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"dt_bias has shape \(7,\), expected \(8,\)"):
        gdn_gating(a, a, torch.zeros(8, device=DEVICE), torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"one \[T, HV\] shape, got \(4, 8\) and \(4, 7\)"):
        gdn_gating(a, a[:, :7], torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE))
