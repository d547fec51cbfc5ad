"""Continuous-batching scheduler: the entry point, load publishing and the main loop.

Request types and the chunk vocabulary live in request.py, what the scheduler owns in state.py, step
drivers in steps.py (a step's rows in rows.py, a speculative step's plan in spec_plan.py), token
dispatch in dispatch.py, where a request dies (retire, failure, pruning,
shutdown fan-out) in lifecycle.py, submission checks in validation.py, per-step ITL telemetry in
telemetry.py and pure policy in plan.py.
One tick, in this fixed order:

  1. finish an async prefill whose result is ready
  2. drain submissions (adds, aborts)
  3. prune requests whose client is gone (queued, prefilling, decoding) - before any admission
  4. reject unsupported contracts and invalid requests (fail-closed, with a reason)
  5. publish load
  6. admit (context length -> KV budget -> state slots -> FCFS)
  7. choose the prefill budget and take chunks
  8. build the plan: Prefill | Decode | Unified (or launch an overlapped prefill); a pure-decode step
     following a decode-ahead step is launched before that step's tokens are read
  9. execute (or launch ahead); dispatch tokens; retire
 10. launch the prefix cache's copies no step carried (end-of-request snapshots); ITL telemetry line

Ownership (request.py): a request is in exactly one queue or has had its single terminal update. Only
the scheduler thread touches the queues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.prefix import PageKeys, salted_root
from deltaserve.engine.backend import Backend
from deltaserve.engine.protocol import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    LoadSnapshot,
    RequestUpdate,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
)
from deltaserve.engine.sampler import make_seed
from deltaserve.engine.scheduler import lifecycle, prefix, steps, telemetry, validation
from deltaserve.engine.scheduler.request import Phase, Request
from deltaserve.engine.scheduler.state import SchedulerConfig, SchedulerState
from deltaserve.engine.structured import GrammarBackend

__all__ = ["Phase", "Request", "Scheduler", "SchedulerConfig", "start_scheduler"]

logger = logging.getLogger(__name__)


class Scheduler(SchedulerState):
    """Owns every request and every cache handle. `submit` may be called from any thread; everything
    else runs on the scheduler thread (`run`, or `tick` in tests)."""

    # ---- entry ---------------------------------------------------------------------------------

    def submit(self, msg: ClientMessage) -> None:
        self.inbox.put(msg)
        self._wake.set()

    def run(self, idle_wait_s: float = 0.05) -> None:
        """The loop: tick until a Shutdown message or a fatal error. Fatal errors fan out one error
        terminal to every owned request before the loop exits. Idle ticks go to the backend's graph
        captures ahead of need, one per tick, until none is left (none while a request waits for its
        grammar); then the loop sleeps until work."""
        try:
            while not self.stopped:
                if self.tick() or self.stopped:
                    continue
                if self.compiling:  # no graph capture in the way of a request whose grammar compiles
                    self._wait_for_work(idle_wait_s)
                    continue
                if not self.backend.capture_ahead():
                    self.captures_ahead_done.set()
                    self._wait_for_work(idle_wait_s)
        except Exception as exc:  # any escape is fatal: every owned request gets its one terminal
            logger.exception("scheduler failed")
            lifecycle.terminal_scheduler_shutdown(self, f"engine failed: {type(exc).__name__}: {exc}")
            raise

    def _wait_for_work(self, timeout: float) -> None:
        """Idle: sleeps until a submission (or the timeout). A message that arrives between the wait and
        the clear is already in the inbox, so the next tick drains it: no wake-up is lost."""
        self._wake.wait(timeout)
        self._wake.clear()

    # ---- the tick ------------------------------------------------------------------------------

    def tick(self) -> bool:
        """One scheduler iteration. Returns False when there was nothing to do."""
        if self.inflight is not None and self.inflight.pending.ready():
            steps.finish_async_prefill(self)
        self._drain_inbox()
        if self.stopped:
            return False
        if self.inflight is not None and any(r.closed for r in self.inflight.requests):
            steps.finish_async_prefill(self)  # drained before pruning: the device may still read their state
        lifecycle.prune_closed_requests(self)
        validation.reject_unsupported(self)
        validation.take_compiled_grammars(self)
        self._publish_load()
        if not (self.waiting or self.prefilling or self.running or self.inflight or self.decode_ahead):
            self._flush()
            return False
        steps.admit(self)
        steps.run_step(self)
        steps.flush_cache_copies(self)
        self._publish_load()
        self._flush()
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequest):
                req = self.by_id.get(msg.request_id)
                if req is not None:
                    req.closed = True
            elif isinstance(msg, ResetPrefixCache):
                self.cache.reset_prefix_cache()
            elif isinstance(msg, Shutdown):
                lifecycle.terminal_scheduler_shutdown(self, msg.reason)
                return

    def _add(self, msg: AddRequest) -> None:
        if msg.request_id in self.by_id:
            self.updates.append(
                RequestUpdate(
                    msg.request_id,
                    finish_reason="rejected",
                    error=f"request id {msg.request_id!r} is already in use",
                    error_field="request_id",
                )
            )
            return
        params = msg.params
        prompt_len = len(msg.prompt_token_ids)
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else self.config.max_model_len - prompt_len
        )
        req = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            params=params,
            max_tokens=max(max_tokens, 1),
            seed=params.seed if params.seed is not None else make_seed(),
            arrival_time=msg.arrival_time or time.monotonic(),
            echo=msg.echo,
        )
        if self.cache.prefix_caching:
            req.cache_points = prefix.cache_points(prompt_len, msg.cache_points)
            req.page_keys = PageKeys(salted_root(msg.cache_salt))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.by_id[req.request_id] = req
        self.waiting.append(req)

    # ---- load publishing -----------------------------------------------------------------------

    def _publish_load(self) -> None:
        kv = self.cache.kv
        states = self.cache.states
        snapshots = self.cache.snapshots
        inflight = len(self.inflight.requests) if self.inflight else 0
        self.load = LoadSnapshot(
            running=len(self.running) + len(self.prefilling) + inflight,
            waiting=len(self.waiting) + len(self.compiling),
            kv_pages_used=kv.num_used,
            kv_pages_total=kv.capacity,
            state_slots_free=states.num_free,
            state_slots_total=states.capacity,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
            kv_pages_cached=kv.num_cached,
            state_snapshots_used=snapshots.num_used if snapshots is not None else 0,
            state_snapshots_total=snapshots.capacity if snapshots is not None else 0,
            spec_num_drafts=self.spec_counters.num_drafts,
            spec_num_draft_tokens=self.spec_counters.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_counters.num_accepted_tokens,
            spec_accepted_per_position=tuple(self.spec_counters.accepted_per_position),
        )

    def _flush(self) -> None:
        if self.updates:
            updates, self.updates = self.updates, []
            self.publish(StepOutputs(updates, self.load))


def start_scheduler(
    config: SchedulerConfig,
    backend: Backend,
    publish: Callable[[StepOutputs], None],
    grammars: GrammarBackend | None = None,
    cache: CacheManager | None = None,
) -> tuple[Scheduler, threading.Thread]:
    """Policy-aware start: the config (policy and its combinations) is validated before the thread
    starts; the returned thread runs the loop until a Shutdown message."""
    scheduler = Scheduler(config, backend, publish, grammars, cache)
    thread = threading.Thread(target=scheduler.run, name="deltaserve-scheduler", daemon=True)
    thread.start()
    telemetry.log_start(config)
    return scheduler, thread
