"""The TMA GEMV at twelve launch shapes beyond its tuned six (python3 <this file>, needs CUDA)."""

from deltaserve.bench import linear_kernel
from deltaserve.ops.triton.gemv_tma import TmaBlocks as B

# (rows, K columns, warps, stages): smaller and deeper pipelines than CONFIGS, 2-8 warps.
LAUNCH_SHAPES = [
    B(8, 256, 4, 4),
    B(4, 256, 2, 8),
    B(8, 256, 2, 6),
    B(8, 256, 4, 8),
    B(8, 256, 8, 6),
    B(16, 256, 8, 8),
    B(16, 128, 4, 8),
    B(32, 64, 4, 8),
    B(64, 64, 4, 6),
    B(16, 256, 4, 3),
    B(4, 256, 4, 12),
    B(8, 128, 2, 12),
]
linear_kernel.tma_main(LAUNCH_SHAPES)
