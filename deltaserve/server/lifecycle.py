"""The server process's life: bind, start the engine, serve, and the two ways it ends.

- Start: the port is bound first (a taken port fails at once, before the model loads) but listens only
  once the engine is ready, so nothing connects to a server that cannot serve yet.
- SIGTERM / SIGINT: stop accepting (/health 503), let in-flight requests run for up to
  --shutdown-timeout-s, then shut the engine down, which gives every request still running its terminal
  (an error event or response); exit 0. A second signal forces the exit at once: the engine is shut
  down now, connections are not waited for; exit 1.
- Engine death, or an engine found hung (engine/liveness.py): /health turns 503 at once, every
  in-flight request gets a 503 error (the engine client fans it out), new requests get 503, and the
  server exits 1 after DEAD_EXIT_DELAY_S: never a server that accepts work it cannot do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from deltaserve.config import read_sampling_defaults
from deltaserve.engine.client import AsyncEngineClient, PeerEngineProcess
from deltaserve.engine.core import resolve_model_dir
from deltaserve.engine.process import EngineLaunch, spawn_engine
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.heap import freeze_startup_heap
from deltaserve.process_clock import since_start_note
from deltaserve.server.admission import Admission
from deltaserve.server.api_workers import (
    WORKER_STOP_SIGNAL,
    ApiWorker,
    ApiWorkers,
    WorkerEntry,
    receive_engine_info,
)
from deltaserve.server.args import ServerConfig
from deltaserve.server.grammar_check import GrammarChecker
from deltaserve.server.listen import bind_socket
from deltaserve.server.logprobs import TokenTexts
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.offload import TextWorkers
from deltaserve.server.response_store import ResponseStore
from deltaserve.server.state import ServerState
from deltaserve.server.stats_log import log_stats_periodically
from deltaserve.tokenizer import Tokenizer

logger = logging.getLogger("deltaserve.server")

DEAD_EXIT_DELAY_S = 1.0  # /health answers 503 this long before the port closes
DEAD_ERROR_GRACE_S = 5.0  # then at most this long for in-flight responses to finish writing their error
DEFAULT_MODEL_NAME = "deltaserve-tiny-random"
SHUTDOWN_REASON = "the server is shutting down"
FORCED_REASON = "the server was stopped (a second signal)"
FORCED_ENGINE_SHUTDOWN_S = 5.0
WORKER_WATCH_INTERVAL_S = 0.2
WORKER_EXIT_GRACE_S = 10.0  # past --shutdown-timeout-s, before a worker still running is killed
# A connection closed at shutdown whose reply is fully written is aborted after this long: asyncio gives
# a closing TLS connection 30 s to receive the peer's close_notify, which an idle keep-alive client never
# sends, and uvicorn waits for every connection to be gone.
CLOSE_NOTIFY_GRACE_S = 0.5


class _DropWritesToGoneClients(logging.Filter):
    """asyncio logs 'socket.send() raised exception.' for every write to a connection that is already
    gone; each client that leaves mid-stream would add lines that say nothing (the request is aborted
    and counted in the metrics)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "socket.send() raised exception."


def warn_random_weights() -> None:
    line = "!" * 96
    print(
        f"{line}\n"
        "!! WARNING: no --model given: serving the embedded tiny checkpoint, whose weights are RANDOM.\n"
        "!! Its output is meaningless text. Pass --model DIR to serve a real Qwen3.5 checkpoint.\n"
        f"{line}",
        file=sys.stderr,
        flush=True,
    )


def generation_defaults(
    source: str, model_dir: Path, overrides: dict[str, float | int] | None = None
) -> dict[str, float | int]:
    """--generation-config: auto reads the model's generation_config.json, vllm reads none, anything
    else names a folder that must hold one; `overrides` (--override-generation-config) go over them."""
    defaults = _generation_file_defaults(source, model_dir)
    if overrides:
        defaults = {**defaults, **overrides}
        logger.info("request defaults after --override-generation-config: %s", defaults)
    return defaults


def _generation_file_defaults(source: str, model_dir: Path) -> dict[str, float | int]:
    if source == "vllm":
        return {}
    if source == "auto":
        path = model_dir / "generation_config.json"
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ConfigError(
                f"--generation-config must be auto, vllm or a folder holding generation_config.json, "
                f"got {source!r} (no {path})"
            )
    defaults = read_sampling_defaults(path)
    if defaults:
        logger.info("request defaults from %s (for fields a request omits): %s", path, defaults)
    return defaults


class _Server(uvicorn.Server):
    """uvicorn's server, told about SIGTERM/SIGINT so in-flight requests can be drained."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None], worker: bool = False) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        # An extra API server process stops when the main one tells it (WORKER_STOP_SIGNAL), once per
        # signal the main process got: a SIGTERM or Ctrl-C sent to the whole process group, which
        # reaches it too, is not counted twice.
        self._worker = worker

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._worker:  # not through uvicorn's handler: it would raise the signal again on its way out
            if sig == WORKER_STOP_SIGNAL:
                self._on_signal()
                self.should_exit = True
            return
        self._on_signal()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        reaper = asyncio.create_task(self._abort_written_closing_connections())
        try:
            await super().shutdown(sockets)
        finally:
            reaper.cancel()

    async def _abort_written_closing_connections(self) -> None:
        """Aborts each connection that has been closing for CLOSE_NOTIFY_GRACE_S with nothing left to
        write (only the TLS close handshake pending); one still writing a reply is left to finish it."""
        closing_since: dict[int, float] = {}
        while True:
            now = time.monotonic()
            for connection in list(self.server_state.connections):
                transport = connection.transport
                if not transport.is_closing() or transport.get_write_buffer_size():
                    continue
                if now - closing_since.setdefault(id(connection), now) >= CLOSE_NOTIFY_GRACE_S:
                    transport.abort()
            await asyncio.sleep(0.1)


class _Lifecycle:
    def __init__(self, state: ServerState, workers: ApiWorkers | None = None) -> None:
        self.state = state
        self.workers = workers  # the extra API server processes (the main process only)
        self.server: _Server | None = None
        self._engine_closing: asyncio.Future[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None  # held so the task is not collected
        self._dead_task: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.forced = False

    def on_signal(self) -> None:
        """Runs in the signal handler: only flags, scheduling and forwarding the signal here."""
        if self.workers is not None:
            self.workers.signal_all()
        if self.state.draining:
            self.forced = True
            if self.server is not None:
                self.server.force_exit = True
            self._loop.call_soon_threadsafe(self._start_forced_close)
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_forced_close(self) -> None:
        logger.warning("second signal: ending %d in-flight requests and exiting now", self.state.inflight)
        asyncio.ensure_future(self.close_engine(FORCED_REASON, FORCED_ENGINE_SHUTDOWN_S))

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain(self.state.config.shutdown_timeout_s))

    async def _drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        logger.info(
            "shutting down: %d requests in flight, waiting up to %.0f s", self.state.inflight, timeout_s
        )
        while self.state.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.inflight:
            logger.warning(
                "%d requests still running after %.0f s; ending them", self.state.inflight, timeout_s
            )
        if self.workers is not None:  # they drain their own requests, which the engine serves to the end
            await self.workers.wait_exited(max(deadline - time.monotonic(), 0.0) + WORKER_EXIT_GRACE_S)
        await self.close_engine(SHUTDOWN_REASON)

    def on_engine_dead(self, reason: str) -> None:
        self.state.dead_reason = reason
        logger.error("%s: /health is 503 and the server exits in %.1f s", reason, DEAD_EXIT_DELAY_S)
        self._dead_task = asyncio.ensure_future(self._exit_after_errors_written())

    async def _exit_after_errors_written(self) -> None:
        """Exits once every in-flight response has ended (each got the engine's error; on a loaded
        machine writing them can take longer than the 503 window), or after the grace period."""
        await asyncio.sleep(DEAD_EXIT_DELAY_S)
        deadline = time.monotonic() + DEAD_ERROR_GRACE_S
        while self.state.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._exit()

    def _exit(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    async def watch_workers(self) -> None:
        """Fails the server closed when an extra API server process exits on its own: /health 503, the
        others told to stop, this one stops accepting and exits 1 once its requests have ended."""
        assert self.workers is not None
        while True:
            await asyncio.sleep(WORKER_WATCH_INTERVAL_S)
            reason = self.workers.first_exited()
            if reason is not None and not self.state.draining:
                self.state.dead_reason = reason
                logger.error("%s: the server stops and exits 1", reason)
                self.workers.signal_all()
                self._exit()
                return

    async def close_engine(self, reason: str, timeout_s: float = 30.0) -> None:
        """Shuts the engine down once; later calls wait for that shutdown to finish."""
        if self._engine_closing is None:
            self._engine_closing = asyncio.ensure_future(self.state.client.shutdown(reason, timeout_s))
        await asyncio.shield(self._engine_closing)


def _ignore_signal(sig: int, frame: FrameType | None) -> None:
    pass


async def _engine_client(
    config: ServerConfig,
    engine_config: EngineConfig,
    launch: EngineLaunch | None,
    api_worker: ApiWorker | None,
) -> AsyncEngineClient:
    if api_worker is None:
        return await AsyncEngineClient.start(
            engine_config, launch=launch, limits=config.hang_limits, stream_interval=config.stream_interval
        )
    attach = api_worker.attach
    info = await asyncio.get_running_loop().run_in_executor(None, receive_engine_info, api_worker.channel)
    return AsyncEngineClient.attach(
        info,
        attach.address,
        PeerEngineProcess(attach.engine_pid, attach.main_pid),
        limits=config.hang_limits,
        stream_interval=config.stream_interval,
    )


async def open_state(
    config: ServerConfig,
    engine_config: EngineConfig,
    sampling_defaults: dict[str, float | int] | None = None,
    launch: EngineLaunch | None = None,
    api_worker: ApiWorker | None = None,
) -> ServerState:
    """Starts the engine process (unless `launch` is one already spawned, or this is an extra API server
    process, `api_worker`, which waits for the main one's engine to be ready), the grammar compiler
    worker and loads the tokenizer (about a second for Qwen's vocabulary) concurrently. The engine
    process is spawned first: the tokenizer load holds the GIL for most of its second, which would
    otherwise delay the spawn by as much."""
    model_dir = resolve_model_dir(engine_config.model)
    engine_start = asyncio.create_task(_engine_client(config, engine_config, launch, api_worker))
    await asyncio.sleep(0)  # the task runs up to its wait for readiness: the process is spawned
    tokenizer_load = asyncio.get_running_loop().run_in_executor(
        None,
        functools.partial(
            Tokenizer.from_dir,
            model_dir,
            chat_template=config.chat_template,
            chat_template_source=config.chat_template_source,
        ),
    )
    grammars = GrammarChecker(str(model_dir), config.structured_output_compile_timeout_s)
    grammars.start()
    try:
        client = await engine_start
    except BaseException:
        grammars.close()
        with contextlib.suppress(Exception):
            await tokenizer_load
        raise
    try:
        tokenizer = await tokenizer_load
    except BaseException:
        grammars.close()
        await client.shutdown("the tokenizer failed to load")
        raise
    names = config.served_model_names or (engine_config.model or DEFAULT_MODEL_NAME,)
    name = names[0]
    metrics = ServerMetrics(name, lambda: client.load)
    index = 0 if api_worker is None else api_worker.attach.index
    return ServerState(
        config=config,
        client=client,
        tokenizer=tokenizer,
        model_name=name,
        model_aliases=names[1:],
        sampling_defaults=sampling_defaults or {},
        metrics=metrics,
        responses=ResponseStore(config.response_store_size, index, config.api_server_count),
        token_texts=TokenTexts(tokenizer),
        workers=TextWorkers(),
        grammars=grammars,
        admission=Admission(config.max_choices_per_request, config.max_queued_requests, metrics.shed.inc),
    )


def _report_failed_start(api_worker: ApiWorker | None, exc: BaseException) -> None:
    """An extra API server process's start-up failure, for the main process to name."""
    if api_worker is not None:
        api_worker.report("error", str(exc) or type(exc).__name__)


def close_workers(state: ServerState) -> None:
    state.workers.close()
    state.grammars.close()


def quiet_writes_to_gone_clients() -> None:
    logging.getLogger("asyncio").addFilter(_DropWritesToGoneClients())


async def serve(
    config: ServerConfig,
    engine_config: EngineConfig,
    build_app: Callable[[ServerState], FastAPI],
    *,
    sock: socket.socket | None = None,
    launch: EngineLaunch | None = None,
    api_worker: ApiWorker | None = None,
    worker_entry: WorkerEntry | None = None,
) -> int:
    """`sock`: the listening socket when the caller bound it already; `launch`: the engine process
    when the caller spawned it already (`deltaserve serve` does both before importing the server).
    `api_worker`: this is an extra API server process (server/api_workers.py); `worker_entry`: what
    the extra processes run, where --api-server-count asks for them."""
    if engine_config.model is None and api_worker is None:
        warn_random_weights()
    if sock is None:
        sock = bind_socket(config.host, config.port)
    try:
        model_dir = resolve_model_dir(engine_config.model)
        sampling_defaults = generation_defaults(
            config.generation_config, model_dir, config.generation_overrides
        )
        workers = None
        if api_worker is None and config.api_server_count > 1:
            if launch is None:
                launch = spawn_engine(engine_config, config.api_server_count)
            assert worker_entry is not None
            workers = ApiWorkers.spawn(config, engine_config, sock, launch, worker_entry)
    except BaseException as exc:
        _report_failed_start(api_worker, exc)
        sock.close()
        raise
    quiet_writes_to_gone_clients()
    try:
        state = await open_state(config, engine_config, sampling_defaults, launch, api_worker)
    except BaseException as exc:
        _report_failed_start(api_worker, exc)
        if workers is not None:
            workers.kill()
        sock.close()
        raise
    if workers is not None:
        try:
            await workers.release(state.client.info)
        except BaseException:
            await state.client.shutdown("an API server process failed to start")
            close_workers(state)
            sock.close()
            raise
    if api_worker is not None:
        api_worker.report("ready", {})
        api_worker.channel.close()
    name, client = state.model_name, state.client
    life = _Lifecycle(state, workers)
    client.on_dead = life.on_engine_dead
    uv_config = uvicorn.Config(
        build_app(state),
        log_level=config.uvicorn_log_level,
        timeout_graceful_shutdown=config.shutdown_timeout_s + 5.0,
        lifespan="off",
        root_path=config.root_path,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
    )
    life.server = _Server(uv_config, life.on_signal, worker=api_worker is not None)
    if api_worker is not None:
        signal.signal(WORKER_STOP_SIGNAL, life.server.handle_exit)
    # uvicorn re-raises the signal that stopped it once it is done; these handlers make that a no-op, so
    # an orderly shutdown exits with our code rather than being killed by the re-raised signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore_signal)
    background = (
        [asyncio.create_task(log_stats_periodically(state, config.log_interval_s))]
        if config.log_stats
        else []
    )
    if workers is not None:
        background.append(asyncio.create_task(life.watch_workers()))
    host, port = sock.getsockname()[:2]
    scheme = "https" if config.ssl_certfile else "http"
    freeze_startup_heap()
    logger.info(
        "serving %r on %s://%s:%d%s (OpenAPI docs at /docs)%s",
        name,
        scheme,
        host,
        port,
        config.root_path,
        since_start_note(),
    )
    try:
        await life.server.serve(sockets=[sock])
    finally:
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if workers is not None:  # each drains its own requests; the engine serves them to the end
            await workers.wait_exited(config.shutdown_timeout_s + WORKER_EXIT_GRACE_S)
        await life.close_engine(SHUTDOWN_REASON)
        sock.close()
        close_workers(state)
    if state.dead_reason is not None:
        logger.error("exiting: %s", state.dead_reason)
        return 1
    if life.forced:
        logger.error("exiting before in-flight requests finished (a second signal)")
        return 1
    return 0
