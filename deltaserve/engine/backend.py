"""Executes one step plan on one device: runs the rows' forward (engine/worker.py), samples, and starts
the copy of the results to the host.

The backend allocates nothing: every page, slot and context a row names was given by the cache manager
(the scheduler's side), and the scheduler advances the cursors once the step is launched. Sampled
tokens and logprobs come back to the host in one transfer per step; prompt logprobs, where a row asks
for them, are computed and read back during the launch (a synchronous step for those rows).

`launch` returns before the device has finished: the step's results are copied into pinned host memory
behind an event, so waiting for them never waits for steps launched later. A plan's first decode rows
may take their input token from an earlier, still running step's sampled tokens on the device (a
`TokenFeed`): decode step N+1 is launched before step N's tokens reach the host.

Streams. Without prefill overlap all device work runs in launch order on the current stream. With it
(`overlap=True`, CUDA only) the backend owns two: every launch runs on a high-priority main stream,
except an overlapped launch (`launch(plan, overlapped=True)`: an async prefill), which runs on a
low-priority prefill stream that first waits for everything launched before it. Decode steps launched
after it then run beside it, and the GPU schedules their blocks first. What keeps the two apart:
  * an overlapped step touches only its own rows' pages and slots (its requests are in no queue until
    it is waited for), the reserved padding page and slot, and its plan's cache copies; the scheduler
    makes those copies' snapshots findable and releases their sources only once it has waited for it;
  * it never replays a decode graph (their static inputs and pool belong to the main stream); the
    prefill graphs it may replay have a memory pool of their own (engine/core.py);
  * its `PendingStep` carries an event recorded after all of its work, and waiting for it (or finding
    it ready) is what lets the scheduler hand its requests to the main stream.
The scheduler releases a sequence's pages and slot only after every launched step over it has been
waited for, whichever stream ran it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.cache.device import DeviceCaches
from deltaserve.engine.penalty_counts import PenaltyCounts
from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.engine.sampler import Sampler, SamplingRow, logprobs_of
from deltaserve.engine.spec_graphs import SpeculativeGraphs
from deltaserve.engine.speculative import SpeculativeStep
from deltaserve.engine.step import (
    DeviceSpan,
    PendingStep,
    PlannedRow,
    StagedResult,
    StepPlan,
    TokenFeed,
    sample_and_stage,
)
from deltaserve.engine.worker import ModelWorker
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, to_device

SCORE_BLOCK = 256  # prompt positions whose full-vocabulary logits exist at once
# DELTASERVE_SYNC_DEBUG=1: every launch runs under torch.cuda.set_sync_debug_mode("warn"), and the
# warnings go to the log (once per source line): where a launch waits for the device, which costs a
# step launched ahead its head start. Intended waits warn too (prompt logprobs, speculative steps).
# Waits below PyTorch (a kernel's first load, page-locked allocation) do not show.
SYNC_DEBUG = os.environ.get("DELTASERVE_SYNC_DEBUG", "") not in ("", "0", "false")


class Backend:
    def __init__(
        self,
        model: Qwen35ForCausalLM,
        caches: DeviceCaches,
        sampler: Sampler | None = None,
        worker: ModelWorker | None = None,
        spec_graphs: SpeculativeGraphs | None = None,
        overlap: bool = False,
        time_steps: bool = False,
    ) -> None:
        """`time_steps`: each launch on the main stream carries a `DeviceSpan` (CUDA only), for the step
        log's device and idle times."""
        self.model = model
        self.caches = caches
        self.sampler = sampler or Sampler(
            PenaltyCounts(caches.states.num_slots, model.logits_vocab_size, model.device)
        )
        self.worker = worker or ModelWorker(model, caches)  # eager unless given a worker with graphs
        self.device = model.device
        self.speculative = (
            SpeculativeStep(model, caches, self.sampler, spec_graphs, self.worker.prefill_graphs)
            if model.mtp is not None
            else None
        )
        self._sync_debug = SYNC_DEBUG and self.device.type == "cuda"
        self._streams = OverlapStreams.create(self.device) if overlap and self.device.type == "cuda" else None
        self._time_steps = time_steps and self.device.type == "cuda"
        self._last_end: torch.cuda.Event | None = None  # the last timed launch's end on the main stream
        if self._sync_debug:
            logging.captureWarnings(True)

    def capture_ahead(self) -> bool:
        """Idle time: one graph capture ahead of need (engine/prefill_graphs.py); False: none left."""
        with self._on_main():
            return self.worker.capture_ahead()

    @torch.inference_mode()
    def logits(self, rows: list[BatchRow]) -> torch.Tensor:
        """float32 logits [R, vocab] of the rows that need them (every row by default), in row order:
        the forward alone, for tests and tools that drive the model row by row."""
        with self._on_main():
            return self.worker.run(rows)[0]

    def launch(self, plan: StepPlan, overlapped: bool = False) -> PendingStep:
        """Runs the plan's forward and the sampler and starts copying the results to the host; returns
        without waiting for the device. A speculative step (plan.num_drafts > 0) is read during its
        launch: its rows' lengths depend on what the target accepts. `overlapped`: an async prefill,
        run beside the decode steps launched after it (on the prefill stream, with overlap on; see the
        module docstring); it never replays a decode graph."""
        if not self._sync_debug:
            return self._launch_on_stream(plan, overlapped)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return self._launch_on_stream(plan, overlapped)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def _launch_on_stream(self, plan: StepPlan, overlapped: bool) -> PendingStep:
        streams = self._streams
        if not overlapped or streams is None:
            with self._on_main():
                if not self._time_steps:
                    return self._launch(plan, decode_graphs=not overlapped)
                start = DeviceSpan.mark()
                pending = self._launch(plan, decode_graphs=not overlapped)
                pending.device_span = DeviceSpan(start, DeviceSpan.mark(), self._last_end)
                self._last_end = pending.device_span.end
                return pending
        streams.prefill.wait_stream(streams.main)  # its inputs: everything launched before it
        with torch.cuda.stream(streams.prefill):
            try:
                pending = self._launch(plan, decode_graphs=False)
            except BaseException:
                # A launch that failed part-way (out of memory) may have queued work on its rows' pages
                # and slots, which the scheduler releases at once: none of it may run past that.
                streams.prefill.synchronize()
                raise
            pending.finished = torch.cuda.Event()
            pending.finished.record(streams.prefill)
        return pending

    def _on_main(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._streams is None else torch.cuda.stream(self._streams.main)

    @torch.inference_mode()
    def _launch(self, plan: StepPlan, decode_graphs: bool = True) -> PendingStep:
        if plan.penalty_tokens or plan.penalty_resets:
            counts = self.sampler.penalty_counts
            if counts is None:
                raise ValueError("a plan with penalty counts needs a sampler that keeps them")
            counts.apply(plan.penalty_tokens, plan.penalty_resets)
        if plan.num_drafts:
            if self.speculative is None:
                raise ValueError("a speculative step needs a model with an MTP head")
            return PendingStep.done(self.speculative.run(plan, self._score_prompts))
        planned = plan.rows
        rows = [r.batch_row() for r in planned]
        fed = None if plan.feed is None else _fed_tokens(plan.feed, rows, self.device)
        logits, scored_hidden = self.worker.run(
            rows,
            fed,
            copies_before=plan.copies_before,
            copies_after=plan.copies_after,
            decode_graphs=decode_graphs,
        )
        prompt = None if scored_hidden is None else self._score_prompts(planned, scored_hidden)
        sampling = [r.sampling for r in planned if r.sampling is not None]
        if not sampling:
            return PendingStep(None, None, sampling, prompt)
        if fed is not None and any(r.grammar is not None for r in sampling):
            # A grammar's mask needs the token in flight on the host: the scheduler samples the step once
            # it has dispatched the step before (PendingStep.sample), on the stream of this launch.
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            return PendingStep(
                None, None, sampling, prompt, lambda: self._sample_later(stream, logits, sampling, fed)
            )
        token_ids, staged = sample_and_stage(self.sampler, logits, sampling, fed)
        return PendingStep(token_ids, staged, sampling, prompt)

    @torch.inference_mode()
    def _sample_later(
        self,
        stream: torch.cuda.Stream | None,
        logits: torch.Tensor,
        sampling: list[SamplingRow],
        fed: torch.Tensor,
    ) -> tuple[torch.Tensor, StagedResult]:
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            return sample_and_stage(self.sampler, logits, sampling, fed)

    def _score_prompts(
        self, planned: Sequence[PlannedRow], hidden: torch.Tensor
    ) -> list[list[TokenLogprobs] | None]:
        """Prompt logprobs of the scored rows, from the raw distribution, SCORE_BLOCK positions at a time."""
        out: list[list[TokenLogprobs] | None] = []
        offset = 0
        for row in planned:
            if row.scoring is None:
                out.append(None)
                continue
            scoring, scored = row.scoring, []
            for start in range(0, len(scoring.targets), SCORE_BLOCK):
                targets = scoring.targets[start : start + SCORE_BLOCK]
                states = hidden[offset + start : offset + start + len(targets)]
                lp = logprobs_of(
                    self.model.compute_logits(states), to_device(targets, torch.int64, self.device), scoring.k
                )
                for logprob, rank, ids, values in zip(
                    lp.sampled_logprob.tolist(),
                    lp.sampled_rank.tolist(),
                    lp.top_ids.tolist(),
                    lp.top_logprobs.tolist(),
                    strict=True,
                ):
                    scored.append(TokenLogprobs(logprob, rank, list(zip(ids, values, strict=True))))
            offset += len(scoring.targets)
            out.append(scored)
        return out


@dataclass(frozen=True, slots=True)
class OverlapStreams:
    """The two streams of prefill overlap: `main` runs every launch but the overlapped ones, at the
    device's highest priority; `prefill` runs those, at its lowest."""

    main: torch.cuda.Stream
    prefill: torch.cuda.Stream

    @classmethod
    def create(cls, device: torch.device) -> OverlapStreams:
        # Priorities past the device's range are clamped to it: these are its highest and lowest.
        main = torch.cuda.Stream(device, priority=-100)
        main.wait_stream(torch.cuda.current_stream(device))  # start-up's work (weights, graphs) first
        return cls(main, torch.cuda.Stream(device, priority=100))


def _fed_tokens(feed: TokenFeed, rows: Sequence[BatchRow], device: torch.device) -> torch.Tensor:
    n = len(feed.rows)
    if n > len(rows) or any(len(r.token_ids) != 1 for r in rows[:n]):
        raise ValueError(f"a token feed covers {n} rows; each must be one of the step's first one-token rows")
    source = feed.source.token_ids
    if source is None:
        raise ValueError("a token feed needs a source step that sampled tokens")
    if feed.rows == list(range(n)):
        return source[:n]
    return source.index_select(0, to_device(feed.rows, torch.int64, device))
