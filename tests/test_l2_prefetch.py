"""The weight prefetch of GEMV decode steps (ops.prefetch_weight, ops/triton/prefetch.py): its switch, when
it launches, and that every prefetch a forward makes names the projection the forward streams next.

The prefetch changes no value (its kernel writes nothing), so the forward's results are the same with it on
and off; on the GPU that is checked bit for bit (tests/gpu/test_l2_prefetch_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from decode_row import after_two_tokens
from hopper_ptx import COMPILE_FOR_HOPPER, hopper_ptx

import deltaserve.ops as ops
from deltaserve.model import qwen35
from deltaserve.model.layers import attention, gdn, mlp
from deltaserve.ops.triton import device_info, prefetch
from deltaserve.ops.triton import linear as triton_linear

MODULES_THAT_PREFETCH = (qwen35, attention, gdn, mlp)


@pytest.mark.parametrize(("text", "mib"), [("0", 0), ("16", 16), (" 8 ", 8)])
def test_the_setting_reads_mib(text, mib):
    assert ops.parse_prefetch_mib(text) == mib


@pytest.mark.parametrize("text", ["-1", "x", "1.5", ""])
def test_a_bad_setting_names_the_variable_and_the_value(text):
    with pytest.raises(
        ValueError, match=rf"DELTASERVE_L2_PREFETCH_MIB must be an integer >= 0 \(MiB\), got '{text}'"
    ):
        ops.parse_prefetch_mib(text)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, int]]:
    """prefetch_l2's calls, with the op boundary taking CPU tensors for a Hopper GPU's."""
    calls: list[tuple[torch.Tensor, int]] = []
    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(device_info, "hopper_or_later", lambda device: True)
    monkeypatch.setattr(prefetch, "prefetch_l2", lambda t, max_bytes: calls.append((t, max_bytes)))
    monkeypatch.setattr(ops, "L2_PREFETCH_MIB", 16)
    monkeypatch.setattr(ops, "GEMV_ROWS", 1)
    return calls


def test_a_gemv_row_prefetches_the_set_mib(launches):
    w = torch.zeros(8, 4)
    ops.prefetch_weight(1, w)
    assert len(launches) == 1 and launches[0][0] is w and launches[0][1] == 16 << 20


@pytest.mark.parametrize(
    "case", ["off", "two rows", "no rows", "no weight", "strided weight", "older gpu", "reference ops"]
)
def test_no_prefetch_outside_gemv_rows_on_hopper(case, launches, monkeypatch):
    w, rows = torch.zeros(8, 4), 1
    if case == "off":
        monkeypatch.setattr(ops, "L2_PREFETCH_MIB", 0)
    elif case == "two rows":
        rows = 2
    elif case == "no rows":
        rows = 0
    elif case == "no weight":
        w = None
    elif case == "strided weight":
        w = w.t()
    elif case == "older gpu":
        monkeypatch.setattr(device_info, "hopper_or_later", lambda device: False)
    else:
        monkeypatch.setattr(ops, "use_kernels", lambda t: False)
    ops.prefetch_weight(rows, w)
    assert launches == []


def test_more_gemv_rows_prefetch_too(launches, monkeypatch):
    monkeypatch.setattr(ops, "GEMV_ROWS", 4)
    ops.prefetch_weight(4, torch.zeros(8, 4))
    assert len(launches) == 1


def test_a_gemv_row_carries_the_next_weight_to_its_kernel(launches, monkeypatch):
    seen = []
    monkeypatch.setattr(triton_linear, "gemv", lambda x, w, prefetch=None: seen.append(prefetch) or x @ w.t())
    x, w, following = (torch.zeros(rows, 4, dtype=torch.bfloat16) for rows in (1, 8, 2))
    ops.linear(x, w, following)
    ops.linear(x, w)
    assert seen[0] == triton_linear.NextWeight(following, 16 << 20) and seen[1] is None


def test_the_kernel_refuses_a_tensor_off_a_hopper_gpu():
    with pytest.raises(
        ValueError, match="a prefetch needs a contiguous tensor on a GPU of compute capability 9.0"
    ):
        prefetch.prefetch_l2(torch.zeros(8), 1 << 20)


def _decode_row_projections(preset: str, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.Tensor]]:
    """The weights one decode row's forward and logits stream, in order ("linear"), with each weight
    named for a prefetch in its place ("prefetch"): after the projection whose GEMV carries it, or where
    the step's first projection gets a kernel of its own."""
    backend, row = after_two_tokens(preset, torch.float32, 0.02)

    events: list[tuple[str, torch.Tensor]] = []
    real_linear = ops.linear

    def recording_linear(x, weight, then=None):
        events.append(("linear", weight))
        out = real_linear(x, weight, then)
        if then is not None:  # the GEMV prefetches `then` as it ends
            events.append(("prefetch", then))
        return out

    def recording_prefetch(rows, weight):
        assert rows == 1
        if weight is not None:
            events.append(("prefetch", weight))

    for module in (ops, *MODULES_THAT_PREFETCH):
        monkeypatch.setattr(module, "linear", recording_linear, raising=False)
    monkeypatch.setattr(qwen35, "prefetch_weight", recording_prefetch)
    backend.logits([row])
    return events


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr()


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_each_prefetch_names_the_next_projection_streamed(preset, monkeypatch):
    events = _decode_row_projections(preset, monkeypatch)
    prefetched = [w for kind, w in events if kind == "prefetch"]
    assert prefetched, "a decode row's forward prefetches"
    for i, (kind, w) in enumerate(events):
        if kind == "prefetch":
            following = next(v for k, v in events[i + 1 :] if k == "linear")
            assert _same_storage(following, w), f"prefetch #{i} is not the next projection's weight"
    if preset == "tiny":  # every projection of a dense model is prefetched, the LM head's too
        assert len(prefetched) == sum(kind == "linear" for kind, _ in events)


def _index(code: list[str], pattern: str, last: bool = False) -> int:
    found = [i for i, line in enumerate(code) if pattern in line]
    assert found, f"no {pattern!r} in the kernel"
    return found[-1] if last else found[0]


def test_the_kernel_of_its_own_prefetches_after_its_wait():
    """The bulk prefetch survives compilation as the kernel's one memory instruction (it fails if the asm
    is marked pure), after the PDL wait, issued by one thread."""
    code = hopper_ptx(COMPILE_FOR_HOPPER, "prefetch")
    assert _index(code, "griddepcontrol.wait") < _index(code, "cp.async.bulk.prefetch.L2.global")
    assert "%tid.x" in code[_index(code, "cp.async.bulk.prefetch.L2.global")]
    assert not [line for line in code if line.startswith(("ld.global", "st.global"))]


def test_a_gemv_prefetches_after_its_stores():
    code = hopper_ptx(COMPILE_FOR_HOPPER, "gemv")
    assert _index(code, "st.global", last=True) < _index(code, "cp.async.bulk.prefetch.L2.global")
