"""Extra API server processes (`--api-server-count N`): N-1 processes beside the main one, each with its
own event loop, engine client, tokenizer and routes, accepting connections on the one listening socket.
At high concurrency the API work of every streamed token (its detokenization, its chunk, and above all
the socket write of its event) outgrows one core; the engine stays one process whatever N is, and
sends each request's outputs to the process that sent it (engine/client_sockets.py).

The main process owns the engine and the workers:
- start: it spawns the workers while the engine loads, sends them the engine's info once it is ready,
  and waits for each to report ready before it serves; a worker that fails to start fails the server's
  start, naming the worker.
- SIGTERM / SIGINT to the main process: passed on to every worker as WORKER_STOP_SIGNAL (each drains
  its own requests as the main does, a second signal forces it too); the engine is shut down once the
  workers have exited. Workers ignore SIGTERM and SIGINT themselves: sent to the whole process group
  (a terminal's Ctrl-C, `timeout`, a service manager), they reach the main process too.
- a worker that exits on its own: the server fails closed: /health turns 503, the other workers are
  told to stop, the main stops accepting, lets its requests end and exits 1.
- the engine dies, or the main process does: each worker's client sees it (by the engine's pid, by its
  own parent) and the worker exits 1 as a lone server would.
What each process holds alone: its in-flight requests, its `--max-queued-requests` queue, its stored
responses (a response is found by the process that answered it). /metrics sums every process's
request metrics (prometheus_client's multiprocess mode, where `deltaserve serve` sets it up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from deltaserve.engine.client import wait_for_start_up_report
from deltaserve.engine.client_sockets import ClientAddress
from deltaserve.engine.core import EngineInfo
from deltaserve.engine.process import EngineLaunch
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.process_name import API_WORKER_NAME, set_process_name
from deltaserve.server.args import ServerConfig

logger = logging.getLogger("deltaserve.server")

WORKER_START_TIMEOUT_S = 300.0
# How the main process tells a worker to stop (a second time: at once). Workers leave SIGTERM and SIGINT
# to the main process, which gets them whether they were sent to it or to the whole process group.
WORKER_STOP_SIGNAL = signal.SIGUSR2


@dataclass(frozen=True, slots=True)
class WorkerAttach:
    """What an extra API server process needs to serve beside the main one; the engine's EngineInfo
    follows on its channel once the engine is ready."""

    index: int  # 1..N-1 (the main process is 0)
    address: ClientAddress  # its sockets to the engine
    engine_pid: int
    main_pid: int


@dataclass(frozen=True, slots=True)
class ApiWorker:
    """This process is extra API server process `attach.index`: `channel` brings the engine's info and
    takes its start-up report."""

    attach: WorkerAttach
    channel: Connection

    def report(self, status: str, payload: object) -> None:
        with contextlib.suppress(OSError):  # the main process is gone: the worker exits on its own
            self.channel.send((status, payload))


# An extra API server process's entry point: (config, engine config, listening socket, attach, channel),
# the channel a duplex pipe to the main process: EngineInfo's fields in, its start-up report out.
WorkerEntry = Callable[[ServerConfig, EngineConfig, socket.socket, "WorkerAttach", Connection], None]


def worker_process_name(index: int) -> str:
    return f"{API_WORKER_NAME}{index}"


def receive_engine_info(channel: Connection) -> EngineInfo:
    """In an extra API server process: blocks until the main process sends the ready engine's info."""
    try:
        return EngineInfo(**channel.recv())
    except EOFError:
        raise ConfigError("the main API server process stopped before its engine was ready") from None


class ApiWorkers:
    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._channels: list[Connection] = []

    @classmethod
    def spawn(
        cls,
        config: ServerConfig,
        engine_config: EngineConfig,
        sock: socket.socket,
        launch: EngineLaunch,
        entry: WorkerEntry,
    ) -> ApiWorkers:
        """Spawns workers 1..N-1, each running `entry` (a module-level function: it is spawned), while
        the engine loads: their imports, tokenizer and routes are ready by the time it is (`release`)."""
        if len(launch.clients) < config.api_server_count:
            raise ConfigError(
                f"--api-server-count {config.api_server_count} needs an engine started for as many "
                f"API server processes, got one for {len(launch.clients)}"
            )
        mp = multiprocessing.get_context("spawn")
        worker_config = dataclasses.replace(config, log_stats=False)  # the main logs the load
        workers = cls()
        try:
            for k in range(1, config.api_server_count):
                attach = WorkerAttach(k, launch.clients[k], launch.process.pid, os.getpid())
                main_end, worker_end = mp.Pipe()
                process = mp.Process(
                    target=entry,
                    args=(worker_config, engine_config, sock, attach, worker_end),
                    name=f"deltaserve-api{k}",
                )
                process.start()
                worker_end.close()
                workers.processes.append(process)
                workers._channels.append(main_end)
        except BaseException:
            workers.kill()
            raise
        return workers

    async def release(self, info: EngineInfo, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        """Sends every worker the ready engine's info and returns once each has reported ready."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_s
        try:
            for channel in self._channels:
                with contextlib.suppress(OSError):  # a worker that died: its report says so below
                    channel.send(dataclasses.asdict(info))
            for k, (process, channel) in enumerate(zip(self.processes, self._channels, strict=True), start=1):
                status, payload = await loop.run_in_executor(
                    None, wait_for_start_up_report, channel, process, deadline, timeout_s
                )
                if status != "ready":
                    raise ConfigError(f"API server process {k} failed to start: {payload}")
        except BaseException:
            self.kill()
            raise
        finally:
            for channel in self._channels:
                channel.close()
        logger.info("%d more API server processes serve the port", len(self.processes))

    def signal_all(self, sig: int = WORKER_STOP_SIGNAL) -> None:
        """Safe in a signal handler."""
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, sig)

    def first_exited(self) -> str | None:
        for k, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return f"API server process {k} exited (exit code {process.exitcode})"
        return None

    async def wait_exited(self, timeout_s: float) -> None:
        """Joins every worker within `timeout_s`, then kills what is left."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            await loop.run_in_executor(None, process.join, max(deadline - time.monotonic(), 0.0))
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)


def set_up_worker_process(attach: WorkerAttach) -> None:
    """The first thing an extra API server process does: its log lines and its name in ps say which
    it is."""
    logging.basicConfig(
        level=os.environ.get("DELTASERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s api{attach.index} %(name)s %(levelname)s %(message)s",
    )
    set_process_name(worker_process_name(attach.index))
