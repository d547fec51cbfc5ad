"""Asyncio client of an EngineCore running in its own process (what the API server uses).

`AsyncEngineClient.start(config)` spawns the engine process (or takes over one that
engine/process.py's `spawn_engine` started earlier) and returns once the engine is ready (model
loaded, caches sized). `generate()` submits one request and yields its RequestUpdates until the terminal
one (with a stream interval N, its first token at once, then N tokens to an update: releases_held);
leaving the iterator early (client disconnect, cancellation) aborts the engine request. If the engine
process dies, or hangs, every in-flight request's iterator raises EngineDeadError, `dead` turns
true and `on_dead` is called (the server turns /health 503 and exits non-zero): never a zombie that
accepts work.

A hung engine (engine/liveness.py: told from a slow one by its heartbeats) is killed, then treated as
dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import zmq
import zmq.asyncio

from deltaserve.engine.client_sockets import ClientAddress
from deltaserve.engine.core import EngineInfo
from deltaserve.engine.liveness import HangLimits, hang_reason
from deltaserve.engine.process import EngineLaunch, spawn_engine
from deltaserve.engine.protocol import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    Heartbeat,
    LoadSnapshot,
    RequestUpdate,
    ResetPrefixCache,
    Shutdown,
    coalesce_updates,
    decode_engine_message,
    encode_client_message,
)
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.2


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class _EngineGone:
    """Put on every in-flight request's queue when the engine dies or the client shuts down."""

    reason: str


def wait_for_start_up_report(
    ready: Connection, process: multiprocessing.process.BaseProcess, deadline: float, timeout_s: float
) -> tuple[str, object]:
    """The engine's ("ready", info) or ("error", message), or an error of our own if it exited silently
    or ran past `deadline`. A report sent just before the engine exited is still in the pipe once the
    process is seen dead, so the pipe is read once more then: the engine's own message wins over its
    exit code."""
    while time.monotonic() < deadline:
        try:
            if ready.poll(0.2):
                return ready.recv()
            if not process.is_alive() and ready.poll(0):
                return ready.recv()
        except EOFError:  # the engine's end closed with nothing sent: it died before reporting
            pass
        if not process.is_alive():
            process.join(1.0)  # the exit code is set once the process is reaped
            return ("error", f"the engine process exited during start-up (exit code {process.exitcode})")
    return ("error", f"the engine did not become ready within {timeout_s:.0f} s")


@dataclass(slots=True)
class _Stream:
    """One in-flight request's side of the client: its reader's queue, and the updates received but
    held back for the stream interval (they wake no reader until released)."""

    queue: asyncio.Queue[RequestUpdate | _EngineGone]
    held: list[RequestUpdate] = field(default_factory=list)
    held_tokens: int = 0
    token_sent: bool = False

    def receive(self, update: RequestUpdate, stream_interval: int) -> None:
        if stream_interval <= 1:  # nothing is ever held
            self.queue.put_nowait(update)
            return
        self.held.append(update)
        self.held_tokens += len(update.new_token_ids)
        if releases_held(self.held_tokens, stream_interval, self.token_sent, update.finished):
            self.release()

    def release(self) -> None:
        if self.held:
            update = coalesce_updates(self.held)
            self.token_sent = self.token_sent or bool(update.new_token_ids)
            self.queue.put_nowait(update)
            self.held, self.held_tokens = [], 0

    def end(self, reason: str) -> None:
        """The engine is gone (or the client shuts down): what is held first, then the end."""
        self.release()
        self.queue.put_nowait(_EngineGone(reason))


class PeerEngineProcess:
    """The engine process as an extra API server process sees it (--api-server-count): started by the
    main API server process, which alone shuts it down, joins it or kills it. It counts as gone once
    its pid has exited, or once the main process is (the engine exits with its parent)."""

    exitcode = None

    def __init__(self, pid: int, main_pid: int) -> None:
        self.pid = pid
        self._main_pid = main_pid

    def is_alive(self) -> bool:
        if os.getppid() != self._main_pid:
            return False
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZX"  # a zombie has exited, unreaped

    def gone_reason(self) -> str:
        if os.getppid() != self._main_pid:
            return "the main API server process is gone"
        return "the engine process exited"

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


def _gone_reason(process: multiprocessing.process.BaseProcess | PeerEngineProcess) -> str:
    if isinstance(process, PeerEngineProcess):
        return process.gone_reason()
    return f"the engine process exited (exit code {process.exitcode})"


def releases_held(held_tokens: int, stream_interval: int, token_sent: bool, finished: bool) -> bool:
    """Whether a request's held updates go to its consumer now: at every update for an interval of 1;
    else the first token at once, then once `stream_interval` tokens are held, and the terminal."""
    return stream_interval <= 1 or finished or not token_sent or held_tokens >= stream_interval


class AsyncEngineClient:
    def __init__(
        self,
        info: EngineInfo,
        process: multiprocessing.process.BaseProcess | PeerEngineProcess,
        ctx: zmq.asyncio.Context,
        push: zmq.asyncio.Socket,
        pull: zmq.asyncio.Socket,
        sock_dir: str,
        limits: HangLimits,
        stream_interval: int = 1,
    ) -> None:
        self.info = info
        self.stream_interval = stream_interval  # tokens per update a consumer gets (releases_held)
        self.load = LoadSnapshot(
            kv_pages_total=info.kv_pages,
            state_slots_free=info.max_num_seqs,
            state_slots_total=info.max_num_seqs,
        )
        self.dead = False
        self.dead_reason: str | None = None
        self.on_dead: Callable[[str], None] | None = None
        self.on_outputs: Callable[[list[RequestUpdate]], None] | None = None  # metrics hook
        self._process = process
        self._ctx = ctx
        self._push = push
        self._pull = pull
        self._sock_dir = sock_dir
        self._limits = limits
        self._streams: dict[str, _Stream] = {}
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._last_heard = time.monotonic()  # any message from the engine
        self._last_heartbeat: Heartbeat | None = None

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        *,
        launch: EngineLaunch | None = None,
        startup_timeout_s: float = 1800.0,
        limits: HangLimits | None = None,
        stream_interval: int = 1,
    ) -> AsyncEngineClient:
        """Connects to `launch` (an engine process already spawned by spawn_engine(config)) or spawns
        one, and returns once the engine is ready. `stream_interval`: see releases_held."""
        if launch is None:
            launch = spawn_engine(config)
        process, ready = launch.process, launch.ready
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.bind(launch.input_addr)  # the engine connects once it is built, so binding now is in time
        pull = ctx.socket(zmq.PULL)
        pull.bind(launch.output_addr)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + startup_timeout_s

        status, payload = await loop.run_in_executor(
            None, wait_for_start_up_report, ready, process, deadline, startup_timeout_s
        )
        if status != "ready":
            push.close(0)
            pull.close(0)
            ctx.term()
            launch.abandon()
            raise ConfigError(str(payload))
        client = cls(
            EngineInfo(**payload),
            process,
            ctx,
            push,
            pull,
            launch.sock_dir,
            limits or HangLimits(),
            stream_interval,
        )
        client._tasks = [asyncio.create_task(client._receive()), asyncio.create_task(client._watchdog())]
        return client

    @classmethod
    def attach(
        cls,
        info: EngineInfo,
        address: ClientAddress,
        engine: PeerEngineProcess,
        *,
        limits: HangLimits | None = None,
        stream_interval: int = 1,
    ) -> AsyncEngineClient:
        """The client of an extra API server process: the engine, already running and serving the main
        process, connected to `address` when it started and reads this client's requests there once
        this binds it. Shutting this client down ends only its own requests."""
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.bind(address.input)
        pull = ctx.socket(zmq.PULL)
        pull.bind(address.output)
        client = cls(info, engine, ctx, push, pull, "", limits or HangLimits(), stream_interval)
        client._tasks = [asyncio.create_task(client._receive()), asyncio.create_task(client._watchdog())]
        return client

    # ---- requests ------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_points: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestUpdate]:
        if self.dead or self._closing:
            raise EngineDeadError(self.dead_reason or "the engine is not running (shutting down)")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue[RequestUpdate | _EngineGone] = asyncio.Queue()
        self._streams[request_id] = _Stream(q)
        finished = False
        try:
            await self._send(
                AddRequest(
                    request_id,
                    list(prompt_token_ids),
                    params,
                    arrival_time=time.monotonic(),
                    cache_points=list(cache_points or ()),
                    cache_salt=cache_salt,
                )
            )
            while True:
                # Everything queued for this request since it was last read leaves as one update: a
                # consumer that fell behind the engine catches up in one delta, not one per step.
                batch: list[RequestUpdate | _EngineGone] = [await q.get()]
                while not q.empty() and isinstance(batch[-1], RequestUpdate) and not batch[-1].finished:
                    batch.append(q.get_nowait())
                gone = batch.pop() if isinstance(batch[-1], _EngineGone) else None
                if batch:
                    update = coalesce_updates(batch)  # type: ignore[arg-type]
                    finished = update.finished
                    yield update
                    if finished:
                        return
                if gone is not None:
                    finished = True
                    raise EngineDeadError(gone.reason)
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self.dead:
                await self.abort(request_id)

    async def reset_prefix_cache(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        await self._send(ResetPrefixCache())

    async def abort(self, request_id: str) -> None:
        if not self.dead:
            await self._send(AbortRequest(request_id))

    async def _send(self, msg: ClientMessage) -> None:
        await self._push.send(encode_client_message(msg))

    # ---- background tasks ----------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            data = await self._pull.recv()
            self._last_heard = time.monotonic()
            outputs = decode_engine_message(data)
            self.load = outputs.load
            if isinstance(outputs, Heartbeat):
                self._last_heartbeat = outputs
                continue
            if self.on_outputs is not None:
                self.on_outputs(outputs.updates)
            for update in outputs.updates:
                stream = self._streams.get(update.request_id)
                if stream is not None:
                    stream.receive(update, self.stream_interval)

    async def _watchdog(self) -> None:
        while self._process.is_alive():
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            hang = None if self._closing else await self._hang()
            if hang is not None:
                self._process.kill()
                self._mark_dead(hang)
                return
        await asyncio.sleep(WATCHDOG_INTERVAL_S)  # let the engine's last outputs arrive
        if not self._closing:
            self._mark_dead(_gone_reason(self._process))

    async def _hang(self) -> str | None:
        """Why the engine counts as hung, or None. Messages still unread (this loop was busy) are news."""
        silent = time.monotonic() - self._last_heard
        reason = hang_reason(silent, self._last_heartbeat, bool(self._streams), self._limits)
        if (
            reason is not None
            and silent > self._limits.heartbeat_timeout_s
            and await self._pull.poll(timeout=0)
        ):
            return None
        return reason

    def _mark_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        self.dead_reason = reason
        logger.error("%s; failing %d in-flight requests", reason, len(self._streams))
        for stream in list(self._streams.values()):
            stream.end(reason)
        if self.on_dead is not None:
            self.on_dead(reason)

    async def shutdown(self, reason: str = "server shutting down", timeout_s: float = 30.0) -> None:
        """Asks the engine to give every in-flight request its terminal, then stops it. An extra API
        server process's client (attach) aborts its own requests in the engine instead, which serves
        on; each still gets `reason` as its terminal here."""
        self._closing = True
        peer = isinstance(self._process, PeerEngineProcess)
        if peer and not self.dead:
            for request_id in list(self._streams):
                await self._send(AbortRequest(request_id))
        elif self._process.is_alive() and not self.dead:
            await self._send(Shutdown(reason))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._process.join, timeout_s)
            await asyncio.sleep(0.1)  # outputs sent just before exit
        if self._process.is_alive():
            self._process.kill()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in list(self._streams.values()):
            stream.end(reason)
        self._push.close(1000 if peer else 0)  # a peer's aborts must still reach the engine
        self._pull.close(0)
        self._ctx.term()
        if self._sock_dir:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
