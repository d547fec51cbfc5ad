"""Per-step ITL telemetry: DELTASERVE_ITL_DEBUG=1 logs one line per step.

Read once at import. When off, the hot path pays one module-level boolean check per step: no
formatting, no clock reads beyond the step's own.
"""

from __future__ import annotations

import logging
import os

from deltaserve.engine.scheduler.state import SchedulerConfig

logger = logging.getLogger("deltaserve.itl")

ITL_DEBUG = os.environ.get("DELTASERVE_ITL_DEBUG", "") not in ("", "0", "false")


def log_itl_step(
    kind: str, prefill_tokens: int, prefill_reqs: int, decode_rows: int, started: float, ended: float
) -> None:
    logger.info(
        "ITL_STEP mono_us=%d kind=%s prefill_tokens=%d prefill_reqs=%d decode_rows=%d step_us=%d",
        int(ended * 1e6),
        kind,
        prefill_tokens,
        prefill_reqs,
        decode_rows,
        int((ended - started) * 1e6),
    )


def log_start(config: SchedulerConfig) -> None:
    logger.debug(
        "scheduler started: policy=%s overlap=%s decode_ahead=%s max_num_seqs=%d max_num_batched_tokens=%d "
        "(saturated: %d)",
        config.policy,
        config.prefill_overlap,
        config.decode_ahead,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_num_batched_tokens_saturated,
    )
