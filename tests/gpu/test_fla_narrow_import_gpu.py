"""fla's chunked kernel, imported narrowly (ops/triton/gdn.py, ops/triton/narrow_import.py) in a fresh
interpreter, is the function fla's ordinary import gives, and it leaves out what the engine never calls:
fla's layers, its other modules, torch.distributed.tensor and sympy (fla.modules' initialiser imports
them: 702 modules in 1.25 s against 135 in 0.24 s, one CPU core, fla-core 0.6.0)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")

LEFT_OUT = ("torch.distributed.tensor", "sympy", "torch._dynamo", "fla.layers", "fla.modules.fused_bitlinear")


def fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_narrow_import_gives_flas_kernel_and_leaves_the_rest_of_fla_out():
    report = "import json, sys; print(json.dumps({'where': [f.__module__, f.__qualname__], 'loaded': sorted(m for m in %r if m in sys.modules)}))"
    narrow = fresh(
        "from deltaserve.ops.triton.gdn import fla_chunk_gated_delta_rule; f = fla_chunk_gated_delta_rule(); "
        + report % (LEFT_OUT,)
    )
    ordinary = fresh(
        "from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f; " + report % (LEFT_OUT,)
    )
    assert narrow["where"] == ordinary["where"]
    assert narrow["loaded"] == [], narrow
    assert ordinary["loaded"], "the ordinary import no longer loads these: the narrow one gains nothing"
