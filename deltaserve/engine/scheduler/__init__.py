"""Continuous-batching scheduler: request types, the entry point, load publishing and the main loop.

Step drivers live in steps.py, emission (terminal fan-out, pruning, rejections) in emit.py, per-step ITL
telemetry in telemetry.py and pure policy in plan.py. One tick, in this fixed order:

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
 10. ITL telemetry line

Ownership: a request is in exactly one of `waiting`, `prefilling`, `inflight` (an async prefill) or
`running`, or it has had its single terminal update. A decode-ahead step's requests stay in `running`
(`decode_ahead` only holds the step's unread tokens). Only the scheduler thread touches these.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from deltaserve.cache.manager import CacheManager, SequenceCache
from deltaserve.config import policy_error
from deltaserve.engine.backend import Backend
from deltaserve.engine.protocol import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    LoadSnapshot,
    RequestUpdate,
    Shutdown,
    StepOutputs,
    TokenLogprobs,
)
from deltaserve.engine.sampler import make_seed
from deltaserve.engine.scheduler import emit, steps, telemetry
from deltaserve.engine.structured import GrammarBackend, RequestGrammar
from deltaserve.errors import ConfigError
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Phase(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    INFLIGHT = "inflight"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or the rest of the context window
    seed: int  # sampling seed for the request's whole life
    arrival_time: float
    echo: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    seq: SequenceCache | None = None  # pages + state slot while admitted
    phase: Phase = Phase.WAITING
    closed: bool = False  # the client went away; pruned at the next tick
    admitted_order: int = -1  # admission counter: preemption victims are the newest
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    checked: bool = False  # submission checks (contract, fields, token ids) ran
    decode_step: steps.DecodeAhead | None = None  # the latest decode-ahead step launched over it
    # Asked-for prompt logprobs so far (entry i scores prompt token i; entry 0 is None), sent with the
    # first token. Invariant while scoring: a prefill chunk starting at s finds s + 1 entries.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    grammar: RequestGrammar | None = None  # structured output, built by the submission checks

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed if self.seq is not None else 0

    @property
    def num_pending(self) -> int:
        """Tokens still to feed: the unprefilled prompt (and recomputed outputs), or the last token."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, length: int) -> list[int]:
        prompt = self.prompt_token_ids
        end = start + length
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int  # the tokenizer's id space: prompts and stop ids must lie inside it
    eos_token_ids: tuple[int, ...] = ()
    policy: str = "fcfs"
    prefill_overlap: bool = False  # launch prefill chunks asynchronously while decode continues
    decode_ahead: bool = True  # launch decode step N+1 before reading step N's tokens

    def validate(self) -> None:
        error = policy_error(self.policy, self.prefill_overlap)
        if error is not None:
            raise ConfigError(error)


class Scheduler:
    """Owns every request and every cache handle. `submit` may be called from any thread; everything
    else runs on the scheduler thread (`run`, or `tick` in tests)."""

    def __init__(
        self,
        config: SchedulerConfig,
        backend: Backend,
        publish: Callable[[StepOutputs], None],
        grammars: GrammarBackend | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.backend = backend
        self.grammars = grammars  # structured output; None: such requests are rejected
        self.cache: CacheManager = backend.cache
        self.publish = publish
        self.inbox: queue.SimpleQueue[ClientMessage] = queue.SimpleQueue()
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.running: list[Request] = []
        self.inflight: steps.InflightPrefill | None = None
        self.decode_ahead: steps.DecodeAhead | None = None
        self.by_id: dict[str, Request] = {}
        self.updates: list[RequestUpdate] = []  # produced this tick, published at its end
        self.load = LoadSnapshot()  # replaced whole each tick: readable from other threads without locks
        self.num_preemptions = 0
        self.stopped = False
        self._admitted = 0
        self._wake = threading.Event()

    # ---- entry ---------------------------------------------------------------------------------

    def submit(self, msg: ClientMessage) -> None:
        self.inbox.put(msg)
        self._wake.set()

    def run(self, idle_wait_s: float = 0.05) -> None:
        """The loop: tick until a Shutdown message or a fatal error. Fatal errors fan out one error
        terminal to every owned request before the loop exits."""
        try:
            while not self.stopped:
                if not self.tick():
                    self._wait_for_work(idle_wait_s)
        except Exception as exc:  # any escape is fatal: every owned request gets its one terminal
            logger.exception("scheduler failed")
            emit.terminal_scheduler_shutdown(self, f"engine failed: {type(exc).__name__}: {exc}")
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
        emit.prune_closed_requests(self)
        emit.reject_unsupported(self)
        self._publish_load()
        if not (self.waiting or self.prefilling or self.running or self.inflight or self.decode_ahead):
            self._flush()
            return False
        steps.admit(self)
        steps.run_step(self)
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
            elif isinstance(msg, Shutdown):
                emit.terminal_scheduler_shutdown(self, msg.reason)
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
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.by_id[req.request_id] = req
        self.waiting.append(req)

    # ---- load publishing -----------------------------------------------------------------------

    def _publish_load(self) -> None:
        kv = self.cache.kv
        states = self.cache.states
        inflight = len(self.inflight.requests) if self.inflight else 0
        self.load = LoadSnapshot(
            running=len(self.running) + len(self.prefilling) + inflight,
            waiting=len(self.waiting),
            kv_pages_used=kv.num_used,
            kv_pages_total=kv.capacity,
            state_slots_free=states.num_free,
            state_slots_total=states.capacity,
            num_preemptions=self.num_preemptions,
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
) -> tuple[Scheduler, threading.Thread]:
    """Policy-aware start: the config (policy and its combinations) is validated before the thread
    starts; the returned thread runs the loop until a Shutdown message."""
    scheduler = Scheduler(config, backend, publish, grammars)
    thread = threading.Thread(target=scheduler.run, name="deltaserve-scheduler", daemon=True)
    thread.start()
    telemetry.log_start(config)
    return scheduler, thread
