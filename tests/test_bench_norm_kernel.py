"""The elementwise kernels' program-shape sweep: which shapes it tries and how many input copies it
cycles (the timing itself needs CUDA graphs)."""

from __future__ import annotations

import pytest

norm_kernel = pytest.importorskip("deltaserve.bench.norm_kernel")


def test_norm_shapes_keep_a_program_within_the_tile_limit():
    # 128-wide GDN heads: 1..64 rows (at most 8,192 values) x 4 warp counts.
    assert len(norm_kernel.norm_shapes(128)) == 7 * 4
    # The 4B hidden 2560 pads to 4096 columns: 1..4 rows fit 16,384 values.
    assert {r for r, _ in norm_kernel.norm_shapes(2560)} == {1, 2, 4}
    assert {r for r, _ in norm_kernel.norm_shapes(4096)} == {1, 2, 4}
    assert {r for r, _ in norm_kernel.norm_shapes(5120)} == {1, 2}  # pads to 8,192


def test_input_copies_exceed_the_l2_and_stay_bounded():
    assert norm_kernel.copies_for(1) == 16  # a decode row: capped
    assert norm_kernel.copies_for(16 << 20) == 4  # 4 x 16 MiB reaches 64 MiB
    assert norm_kernel.copies_for(200 << 20) == 1  # one copy is past the L2 already
