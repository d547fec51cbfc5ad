"""Programmatic dependent launch (ops/triton/pdl.py): the switch and the kernels' invariant.

A kernel launched with PDL may start while the kernel before it still runs, so every kernel that takes
USE_GDC must wait (`gdc_enter`) before its first memory access: the wait is its first statement. The
interpreter knows no launch option, so a CPU tensor never gets one, switch on or off. The results with PDL
on equal those with it off bit for bit on the GPU (tests/gpu/test_pdl_gpu.py)."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest
import torch

from deltaserve.ops.triton import (
    activation,
    attention,
    conv1d,
    gdn,
    gdn_gating,
    linear,
    moe_gemv,
    norm,
    pdl,
    prefetch,
)

MODULES = (activation, attention, conv1d, gdn, gdn_gating, linear, moe_gemv, norm, prefetch)
# The kernels of a decode step, and the prefill gating between its layers' kernels: each takes USE_GDC.
DECODE_KERNELS = {
    "_silu_and_mul_kernel",
    "_sigmoid_gate_kernel",
    "_gdn_gating_kernel",
    "_qk_norm_rope_write_kv_kernel",
    "_paged_attention_kernel",
    "_merge_splits_kernel",
    "_conv1d_decode_kernel",
    "_gdn_decode_kernel",
    "_gemv_kernel",
    "_skinny_kernel",
    "_rms_norm_kernel",
    "_gated_rms_norm_kernel",
    "_l2_prefetch_kernel",
    "_slots_gate_up_kernel",
    "_slots_down_kernel",
}


def _kernels_taking_use_gdc() -> dict[str, ast.FunctionDef]:
    found = {}
    for module in MODULES:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module)))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "USE_GDC" for a in node.args.args):
                found[node.name] = node
    return found


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def test_every_decode_kernel_takes_use_gdc():
    assert set(_kernels_taking_use_gdc()) == DECODE_KERNELS


# The one kernel that reads memory before its wait: the GEMV loads its weight's first block (read-only while
# steps run; ops/triton/pdl.py). tests/test_kernels_linear.py checks the compiled code's loads before it.
READS_ITS_WEIGHT_FIRST = {"_gemv_kernel"}


@pytest.mark.parametrize("name", sorted(DECODE_KERNELS - READS_ITS_WEIGHT_FIRST))
def test_a_kernel_waits_for_the_kernel_before_it_first(name):
    first = _first_statement(_kernels_taking_use_gdc()[name])
    assert ast.unparse(first) == "gdc_enter(USE_GDC)", f"{name} starts with {ast.unparse(first)!r}"


def test_the_gemv_loads_only_its_weight_before_its_wait():
    fn = _kernels_taking_use_gdc()["_gemv_kernel"]
    wait = next(i for i, stmt in enumerate(fn.body) if ast.unparse(stmt) == "gdc_enter(USE_GDC)")
    calls = [node for stmt in fn.body[:wait] for node in ast.walk(stmt) if isinstance(node, ast.Call)]
    loads = [call for call in calls if ast.unparse(call.func) == "tl.load"]
    assert loads, "the preload is gone: drop the exception"
    assert all(ast.unparse(call.args[0]).startswith(("w_rows", "w_up_rows")) for call in loads)
    allowed = {"tl.load", "tl.arange", "tl.program_id", "rows.to", "tl.cast"}
    assert {ast.unparse(call.func) for call in calls} <= allowed


def test_no_launch_option_on_the_cpu_whatever_the_switch(monkeypatch):
    cpu = torch.device("cpu")
    for enabled in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        assert pdl.launch_options(cpu) == {"USE_GDC": False}
        assert not pdl.use_pdl(cpu)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors reach Triton only in its interpreter"
)
def test_kernels_run_in_the_interpreter_with_the_switch_on(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    x = torch.randn(3, 2, 8)
    w = torch.randn(8)
    expected = norm.rms_norm(x, w, 1e-6)
    monkeypatch.setattr(pdl, "ENABLED", False)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), expected, rtol=0, atol=0)
