"""The "rmsnorm" GEMV fusion's row-width bound (ops.settings.RMS_NORM_FUSION_MAX_K) against the registers its
whole-row sum of squares takes: compiled for sm_90 without a GPU (deltaserve.bench.gemv_registers, in a
process of its own, where Triton compiles instead of interpreting)."""

from __future__ import annotations

import json

import pytest
from hopper_ptx import compiled_output

pytest.importorskip("triton")

SCRIPT = """
import dataclasses, json, sys

import triton

from deltaserve.bench.gemv_registers import registers
from deltaserve.ops.settings import RMS_NORM_FUSION_MAX_K
from deltaserve.ops.triton import linear

k_pow2 = triton.next_power_of_2(RMS_NORM_FUSION_MAX_K)
report = {
    str(config): dataclasses.asdict(registers(linear.ADD_RMS_NORM, k_pow2, *config))
    for config in linear._CONFIGS
}
print(json.dumps(report))
"""


def test_no_tuned_block_shape_spills_at_the_widest_row_the_fusion_takes():
    """At 8,192 one tuned shape spills (52 bytes, Triton 3.9): a bound raised past 4,096 fails here."""
    report = json.loads(compiled_output(SCRIPT, timeout=300).splitlines()[-1])
    assert len(report) == 6
    spilling = {config: r for config, r in report.items() if r["spill_bytes"]}
    assert not spilling, spilling
