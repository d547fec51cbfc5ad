"""The tuning knob of the elementwise kernels' launches and of conv1d's per-sequence kernels: a program
shape (block size, warps) that a sweep (python3 -m deltaserve.bench.norm_kernel, bench.conv1d_kernel
--seq) may set in place of a kernel's default. For the elementwise kernels (SwiGLU, the sigmoid gate) and
conv1d any valid shape gives the same bits: the block size changes which program computes a value, not
how. For the norms the warps may change the order of a row's sum, so a shape becomes a default only where
the sweep's bit check finds the default's bits."""

from __future__ import annotations

MAX_WARPS = 16


def program_shape(
    launch: tuple[int, int] | None, default: tuple[int, int], block: str, field: str = "launch"
) -> tuple[int, int]:
    """`launch` = (`block` per program, warps), or `default` when None. Both powers of two, warps at most
    MAX_WARPS; anything else is refused naming the field (`field`), the expected and the found value."""
    if launch is None:
        return default
    if (
        not isinstance(launch, tuple)
        or len(launch) != 2
        or not all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in launch)
        or launch[1] > MAX_WARPS
    ):
        raise ValueError(
            f"{field} must be ({block} per program, warps), powers of two with warps <= {MAX_WARPS}, "
            f"got {launch!r}"
        )
    return launch
