"""Programmatic dependent launch (ops/triton/pdl.py): the switch and the kernels' invariant.

A kernel launched with PDL may start while the kernel before it still runs, so every kernel that takes
USE_GDC must wait (`gdc_enter`) before it touches memory another kernel writes: before the wait it only
computes indices and loads weight tiles. The interpreter knows no launch option, so a CPU tensor never
gets one, switch on or off. The results with PDL on equal those with it off bit for bit on the GPU
(tests/gpu/test_pdl_gpu.py)."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest
import torch

from deltaserve.ops.triton import activation, attention, conv1d, gdn, linear, norm, pdl

MODULES = (activation, attention, conv1d, gdn, linear, norm)
# The kernels of a decode step: each takes USE_GDC.
DECODE_KERNELS = {
    "_silu_and_mul_kernel",
    "_qk_norm_rope_write_kv_kernel",
    "_paged_attention_kernel",
    "_merge_splits_kernel",
    "_conv1d_decode_kernel",
    "_gdn_decode_kernel",
    "_gemv_kernel",
    "_skinny_kernel",
    "_rms_norm_kernel",
    "_gated_rms_norm_kernel",
}


def _kernels_taking_use_gdc() -> dict[str, ast.FunctionDef]:
    found = {}
    for module in MODULES:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module)))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "USE_GDC" for a in node.args.args):
                found[node.name] = node
    return found


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def _called(nodes: list[ast.stmt]) -> set[str]:
    names = set()
    for node in nodes:
        for call in ast.walk(node):
            if isinstance(call, ast.Call):
                func = call.func
                names.add(func.attr if isinstance(func, ast.Attribute) else ast.unparse(func))
    return names


def _function(module: object, name: str) -> ast.FunctionDef:
    (fn,) = (
        node
        for node in ast.parse(inspect.getsource(module)).body
        if isinstance(node, ast.FunctionDef) and node.name == name
    )
    return fn


# Before its wait a kernel may compute indices and load weight tiles (memory no kernel writes), no more.
PRE_WAIT_CALLS = {"program_id", "arange", "to", "_weight_tile"}


def test_every_decode_kernel_takes_use_gdc():
    assert set(_kernels_taking_use_gdc()) == DECODE_KERNELS


@pytest.mark.parametrize("name", sorted(DECODE_KERNELS))
def test_a_kernel_touches_no_memory_another_kernel_writes_before_it_waits(name):
    body = _body(_kernels_taking_use_gdc()[name])
    waits = [i for i, statement in enumerate(body) if ast.unparse(statement) == "gdc_enter(USE_GDC)"]
    assert len(waits) == 1, f"{name} has {len(waits)} top-level gdc_enter(USE_GDC), expected 1"
    early = _called(body[: waits[0]]) - PRE_WAIT_CALLS
    assert not early, f"{name} calls {sorted(early)} before it waits"


def test_a_weight_tile_is_loaded_from_the_weight_rows_only():
    loads = [
        c
        for c in ast.walk(_function(linear, "_weight_tile"))
        if isinstance(c, ast.Call) and ast.unparse(c.func) == "tl.load"
    ]
    assert len(loads) == 1
    assert {n.id for n in ast.walk(loads[0].args[0]) if isinstance(n, ast.Name)} == {"w_rows", "cols"}
    w_rows = [
        st for st in _body(_function(linear, "_gemv_kernel")) if ast.unparse(st).startswith("w_rows = ")
    ]
    assert [ast.unparse(st) for st in w_rows] == ["w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn"]


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
