"""An engine process without a model, for measuring the API process alone.

It speaks the engine's protocol (engine/protocol.py) over the same sockets, so the API process runs as
it does in production: the engine client, detokenization, the endpoints and SSE. Every `step_s` it gives
each running request one token from a fixed cycle of ordinary words, and ends a request at its
`max_tokens` (finish "length"), on an abort, or at shutdown. It schedules nothing: every request runs
from its arrival, up to `max_num_seqs` at once, the rest waiting in arrival order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq

from deltaserve.engine.client_sockets import ClientAddress, ClientSockets
from deltaserve.engine.core import EngineInfo, resolve_model_dir
from deltaserve.engine.process import EngineLaunch, launch_engine_process
from deltaserve.engine.protocol import (
    HEARTBEAT_INTERVAL_S,
    AbortRequest,
    AddRequest,
    Heartbeat,
    LoadSnapshot,
    RequestUpdate,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
)
from deltaserve.process_name import set_process_name
from deltaserve.tokenizer import Tokenizer

# Ordinary English: one or two tokens a word, as a chat answer streams.
TEXT = (
    "The quick brown fox jumps over the lazy dog while the engine streams one token at a time, "
    "and every client reads its own answer as it arrives, word by word, until the end."
)


@dataclass(frozen=True, slots=True)
class SyntheticEngineConfig:
    model: str | None  # the checkpoint whose tokenizer and limits the API process uses
    step_s: float  # one token per running request per step
    max_num_seqs: int
    max_model_len: int = 32768


@dataclass(slots=True)
class _Running:
    add: AddRequest
    emitted: int = 0


def spawn_synthetic_engine(config: SyntheticEngineConfig, num_clients: int = 1) -> EngineLaunch:
    return launch_engine_process(
        run_synthetic_engine,
        config,
        name="deltaserve-synthetic-engine",
        daemon=True,
        num_clients=num_clients,
    )


def run_synthetic_engine(
    config: SyntheticEngineConfig, clients: tuple[ClientAddress, ...], ready: Connection
) -> None:
    set_process_name("dserve-synth")
    model_dir = resolve_model_dir(config.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    words = tokenizer.encode(TEXT)
    info = EngineInfo(
        model_dir=str(model_dir),
        max_model_len=config.max_model_len,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=(),
        kv_pages=config.max_num_seqs * config.max_model_len // 16,
        page_size=16,
        kv_capacity_tokens=config.max_num_seqs * config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        device="synthetic",
        dtype="none",
    )
    ctx = zmq.Context()
    sockets = ClientSockets(ctx, clients)
    ready.send(("ready", dataclasses.asdict(info)))
    ready.close()
    parent = os.getppid()
    running: dict[str, _Running] = {}
    waiting: deque[AddRequest] = deque()
    next_step = next_beat = time.monotonic()
    while os.getppid() == parent:
        timeout_ms = max(0, int((next_step - time.monotonic()) * 1000))
        updates: list[RequestUpdate] = []
        for msg in sockets.receive(timeout_ms):
            if isinstance(msg, AddRequest):
                waiting.append(msg)
            elif isinstance(msg, AbortRequest):
                gone = running.pop(msg.request_id, None)
                if gone is not None:
                    updates.append(RequestUpdate(msg.request_id, finish_reason="abort"))
                waiting = deque(w for w in waiting if w.request_id != msg.request_id)
            elif isinstance(msg, Shutdown):
                ends = [*running, *(w.request_id for w in waiting)]
                done = [RequestUpdate(r, finish_reason="abort", error=msg.reason) for r in ends]
                sockets.publish(StepOutputs(done, LoadSnapshot()))
                with contextlib.suppress(zmq.ZMQError):
                    sockets.close()
                return
            elif not isinstance(msg, ResetPrefixCache):
                raise TypeError(f"unexpected message {type(msg).__name__}")
        now = time.monotonic()
        if now >= next_step:
            next_step += config.step_s
            if next_step < now:  # fell behind: the next step is one period from now, not a burst
                next_step = now + config.step_s
            while waiting and len(running) < config.max_num_seqs:
                add = waiting.popleft()
                running[add.request_id] = _Running(add)
            for request_id, run in list(running.items()):
                updates.append(_next_token(request_id, run, words, now, config.max_model_len))
                if updates[-1].finished:
                    del running[request_id]
        load = LoadSnapshot(
            running=len(running),
            waiting=len(waiting),
            state_slots_free=config.max_num_seqs - len(running),
            state_slots_total=config.max_num_seqs,
            kv_pages_total=info.kv_pages,
        )
        if updates:
            sockets.publish(StepOutputs(updates, load))
        if now >= next_beat:
            next_beat = now + HEARTBEAT_INTERVAL_S
            sockets.publish(Heartbeat(stalled_s=0.0, load=load))


def _next_token(
    request_id: str, run: _Running, words: list[int], now: float, max_model_len: int
) -> RequestUpdate:
    params = run.add.params
    token = words[run.emitted % len(words)]
    run.emitted += 1
    # As the engine resolves it: no max_tokens means the rest of the context window.
    limit = params.max_tokens or max(1, max_model_len - len(run.add.prompt_token_ids))
    return RequestUpdate(
        request_id,
        new_token_ids=[token],
        finish_reason="length" if run.emitted >= limit else None,
        num_prompt_tokens=len(run.add.prompt_token_ids),
        num_output_tokens=run.emitted,
        queued_time=now - run.add.arrival_time if run.emitted == 1 else None,
    )
