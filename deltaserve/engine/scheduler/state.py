"""What the scheduler is configured with and owns: its queues, its requests, its cache handles.

Only the scheduler thread touches a SchedulerState (`Scheduler.submit` only puts on the inbox). The
step drivers (steps.py), the lifecycle (lifecycle.py) and the submission checks (validation.py) take it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.backend import Backend
from deltaserve.engine.penalty_counts import PenaltyReset
from deltaserve.engine.protocol import ClientMessage, LoadSnapshot, RequestUpdate, StepOutputs
from deltaserve.engine.scheduler.benchmark_drafts import BenchmarkDrafts
from deltaserve.engine.scheduler.plan import StepCost
from deltaserve.engine.scheduler.request import LaunchedStep, Request
from deltaserve.engine.scheduler.speculation import DraftGuard, SpeculationCounters
from deltaserve.engine.structured import GrammarBackend
from deltaserve.engine_config import DEFAULT_KV_RESERVE_TOKENS, SpeculativeConfig, policy_error
from deltaserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int  # the tokenizer's id space: prompts and stop ids must lie inside it
    eos_token_ids: tuple[int, ...] = ()
    policy: str = "fcfs"
    prefill_overlap: bool = False  # launch prefill chunks asynchronously while decode continues
    decode_ahead: bool = True  # launch step N+1 (decode rows and chunks) before reading step N's tokens
    speculative: SpeculativeConfig | None = None  # MTP speculative decoding (the backend has the head)
    # While requests decode, size a step's prefill so the step takes about this long (0: off); see
    # plan.cap_prefill_for_latency.
    decode_latency_budget_ms: float = 0.0
    # The step budget while requests wait for admission (0: max_num_batched_tokens); see
    # plan.step_token_budget.
    max_num_batched_tokens_saturated: int = 0
    # Admission keeps the KV pages of each admitted request's next this many tokens (plan.committed_pages);
    # 1: optimistic admission, growth met by preemption.
    kv_reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS

    def validate(self) -> None:
        error = policy_error(self.policy, self.prefill_overlap)
        if error is not None:
            raise ConfigError(error)
        if self.kv_reserve_tokens < 1:
            raise ConfigError(f"kv_reserve_tokens must be an integer >= 1, got {self.kv_reserve_tokens!r}")


class SchedulerState:
    """Every request and every cache handle the scheduler owns."""

    def __init__(
        self,
        config: SchedulerConfig,
        backend: Backend,
        publish: Callable[[StepOutputs], None],
        grammars: GrammarBackend | None = None,
        cache: CacheManager | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.backend = backend
        self.grammars = grammars  # structured output; None: such requests are rejected
        # The one owner of cache allocation (default: every page and slot of the backend's device pools).
        self.cache = cache if cache is not None else CacheManager.for_device(backend.caches)
        self.publish = publish
        self.inbox: queue.SimpleQueue[ClientMessage] = queue.SimpleQueue()
        self._wake = threading.Event()  # set by every submission: the idle loop sleeps on it
        # Set once the idle ticks have no graph capture left: from then on an idle engine launches
        # nothing, so a request meets no capture in its way (benchmarks wait for it).
        self.captures_ahead_done = threading.Event()
        # Requests whose grammar compiles off this thread while others run (validation.py); they join
        # `waiting` when it is done.
        self.compiling: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.running: list[Request] = []
        self.inflight: LaunchedStep | None = None  # an async prefill (--prefill-overlap)
        self.decode_ahead: LaunchedStep | None = None  # a step launched ahead whose tokens are unread
        self.by_id: dict[str, Request] = {}
        self.updates: list[RequestUpdate] = []  # produced this tick, published at its end
        self.load = LoadSnapshot()  # replaced whole each tick: readable from other threads without locks
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens of first admissions looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached
        spec = config.speculative
        self.benchmark_drafts = BenchmarkDrafts.open(spec, config.vocab_size) if spec is not None else None
        drafts = self.benchmark_drafts
        if drafts is not None and drafts.pins_draft_count:  # every step verifies: see benchmark_drafts
            spec = dataclasses.replace(spec, adaptive=False)
        self.guard = DraftGuard(spec) if spec is not None else None  # None: every step decodes plainly
        self.spec_counters = SpeculationCounters()
        if spec is not None and len(self.cache.scratch_slots) < spec.max_batch * spec.num_speculative_tokens:
            raise ConfigError(
                f"speculative decoding needs {spec.max_batch * spec.num_speculative_tokens} verify scratch "
                f"slots (max_batch {spec.max_batch} x {spec.num_speculative_tokens} drafts); the cache "
                f"manager has {len(self.cache.scratch_slots)}"
            )
        self.step_cost = StepCost()  # measured steps with decode rows and prefill (the latency budget)
        # Whether the last step that planned prefill counted as saturated (plan.is_saturated: the bar to
        # stay is lower than the bar to enter).
        self.saturated = False
        self.stopped = False
        self._admitted = 0
        # Penalties counted on the device (engine/penalty_counts.py): outputs the host has seen and rows
        # to rewrite, both for the next launch.
        self.penalty_tokens: list[tuple[int, int]] = []
        self.penalty_resets: list[PenaltyReset] = []

    def wake(self) -> None:
        """Ends the idle loop's sleep (a submission, or work finished on another thread)."""
        self._wake.set()

    def take_penalty_work(self, *, tokens: bool = True) -> tuple[list[tuple[int, int]], list[PenaltyReset]]:
        """The queued penalty outputs (unless not `tokens`: they then wait for a later launch) and row
        rewrites, for the plan being built."""
        taken = self.penalty_tokens if tokens else []
        if tokens:
            self.penalty_tokens = []
        resets, self.penalty_resets = self.penalty_resets, []
        return taken, resets
