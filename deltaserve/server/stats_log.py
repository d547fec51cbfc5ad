"""The periodic load line while the server is busy (vLLM's shape): running, waiting, KV use, tok/s."""

from __future__ import annotations

import asyncio
import logging
import time

from deltaserve.server.state import ServerState

logger = logging.getLogger("deltaserve.server")


async def log_stats_periodically(state: ServerState, interval_s: float) -> None:
    """Every `interval_s`, one line if anything ran or waited since the last one; silent when idle."""
    totals = state.metrics.totals
    last_prompt, last_generation, last_time = totals.prompt, totals.generation, time.monotonic()
    load = state.client.load
    last_drafts, last_accepted = load.spec_num_drafts, load.spec_num_accepted_tokens
    last_drafted = load.spec_num_draft_tokens
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        elapsed = max(now - last_time, 1e-9)
        load = state.client.load
        prompt, generation = totals.prompt - last_prompt, totals.generation - last_generation
        if load.spec_num_drafts > last_drafts:
            rows = load.spec_num_drafts - last_drafts
            accepted = load.spec_num_accepted_tokens - last_accepted
            drafted = load.spec_num_draft_tokens - last_drafted
            logger.info(
                "speculative decoding: mean acceptance length %.2f, draft acceptance rate %.1f%% over %d "
                "verify rows",
                1.0 + accepted / rows,
                100.0 * accepted / max(drafted, 1),
                rows,
            )
        last_drafts, last_accepted = load.spec_num_drafts, load.spec_num_accepted_tokens
        last_drafted = load.spec_num_draft_tokens
        if load.running or load.waiting or prompt or generation:
            logger.info(
                "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
                "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s",
                load.running,
                load.waiting,
                100.0 * load.kv_usage,
                prompt / elapsed,
                generation / elapsed,
            )
        last_prompt, last_generation, last_time = totals.prompt, totals.generation, now
