"""The EngineCore in its own process, talking ZMQ + msgpack to the API server.

Sockets: the client binds a PUSH socket for requests and a PULL socket for outputs (ipc:// paths in a
private temp dir); the engine connects. Start-up reports over a pipe: ("ready", EngineInfo fields) or
("error", message). The engine exits when the scheduler stops (Shutdown message or fatal error: the
scheduler has then already sent every owned request its terminal), or when its parent dies.

A heartbeat thread sends a Heartbeat every HEARTBEAT_INTERVAL_S (engine/protocol.py) with how long the
scheduler loop has gone without completing a tick: the loop replaces `scheduler.load` on every tick,
idle ones included, so a snapshot that is still the same object means no tick ended since.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import zmq

from deltaserve import memory_history
from deltaserve.engine.client_sockets import ClientAddress, ClientSockets
from deltaserve.engine.protocol import HEARTBEAT_INTERVAL_S, EngineMessage, Heartbeat
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.heap import freeze_startup_heap
from deltaserve.process_clock import since_start_note
from deltaserve.process_name import set_process_name
from deltaserve.stack_dumps import dump_stacks_on_sigusr1
from deltaserve.startup_profile import profiled_startup

if TYPE_CHECKING:
    from deltaserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.1
ENGINE_PROCESS_NAME = "dserve-engine"  # what ps and top show (Linux keeps 15 characters)


@dataclass(slots=True)
class EngineLaunch:
    """A spawned engine process before its clients connect: API server process k binds
    `clients[k].input` (the engine pulls its requests there) and `clients[k].output` (the engine pushes
    its outputs there); `ready` receives the one ("ready", EngineInfo fields) or ("error", message) of
    its start-up."""

    process: multiprocessing.process.BaseProcess
    ready: Connection
    sock_dir: str
    clients: tuple[ClientAddress, ...]

    @property
    def input_addr(self) -> str:
        return self.clients[0].input

    @property
    def output_addr(self) -> str:
        return self.clients[0].output

    def abandon(self) -> None:
        """For a server that fails before its client takes the launch over: kill the process (a
        no-op once it has exited) and remove its socket directory."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.ready.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def spawn_engine(config: EngineConfig, num_clients: int = 1) -> EngineLaunch:
    """Starts the engine process (it loads the model meanwhile); light enough to call before the
    server imports its own modules, so the engine's start-up overlaps theirs. `num_clients`: the API
    server processes that will connect (--api-server-count)."""
    # A daemonic process may not start processes: with tensor parallelism the engine starts its rank
    # processes, so it is not daemonic (it still exits when this process is gone).
    return launch_engine_process(
        run_engine_process,
        config,
        name="deltaserve-engine",
        daemon=config.tensor_parallel_size == 1,
        num_clients=num_clients,
    )


def client_addresses(sock_dir: str, num_clients: int) -> tuple[ClientAddress, ...]:
    """ipc:// addresses in `sock_dir`: `input` and `output` for the first client, `input-k` and
    `output-k` for client k after it."""

    def addr(name: str, k: int) -> str:
        return f"ipc://{os.path.join(sock_dir, name if k == 0 else f'{name}-{k}')}"

    return tuple(ClientAddress(addr("input", k), addr("output", k)) for k in range(num_clients))


def launch_engine_process(
    target: Callable[[Any, tuple[ClientAddress, ...], Connection], None],
    config: Any,
    *,
    name: str,
    daemon: bool,
    num_clients: int = 1,
) -> EngineLaunch:
    """Spawns `target(config, clients, ready)`, an engine speaking engine/protocol.py to `num_clients`
    API server processes on sockets in a private directory, and reporting its start-up on `ready`."""
    sock_dir = tempfile.mkdtemp(prefix="deltaserve-")
    clients = client_addresses(sock_dir, num_clients)
    mp = multiprocessing.get_context("spawn")
    parent_end, child_end = mp.Pipe(duplex=False)
    process = mp.Process(target=target, args=(config, clients, child_end), name=name, daemon=daemon)
    try:
        process.start()
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(sock_dir)
        raise
    child_end.close()
    return EngineLaunch(process, parent_end, sock_dir, clients)


def run_engine_process(config: EngineConfig, clients: tuple[ClientAddress, ...], ready: Connection) -> None:
    logging.basicConfig(
        level=os.environ.get("DELTASERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s engine %(levelname)s %(message)s",
    )
    set_process_name(ENGINE_PROCESS_NAME)
    dump_stacks_on_sigusr1()
    parent = os.getppid()
    recording = memory_history.start_recording()
    try:
        with profiled_startup("engine"):
            from deltaserve.engine.core import EngineCore

            logger.info("engine process: imports done%s", since_start_note())
            core = EngineCore(config)
        freeze_startup_heap()
        logger.info("engine ready%s", since_start_note())
    except ConfigError as exc:  # a flag or checkpoint that cannot be served: its one-line message is all
        ready.send(("error", str(exc)))
        raise SystemExit(1) from exc
    except Exception as exc:
        logger.exception("engine failed to start")
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc

    ctx = zmq.Context()
    sockets = ClientSockets(ctx, clients)
    publish = sockets.publish
    core.start(publish)
    if recording:
        memory_history.mark_serving()
    ready.send(("ready", dataclasses.asdict(core.info)))
    ready.close()
    thread = core.thread
    assert thread is not None
    beating = threading.Event()
    threading.Thread(
        target=_send_heartbeats, args=(core, publish, beating), name="deltaserve-heartbeat", daemon=True
    ).start()
    while thread.is_alive():
        for msg in sockets.receive(int(PARENT_POLL_S * 1000)):
            core.submit(msg)
        if os.getppid() != parent:
            logger.error("the API server process is gone; shutting the engine down")
            core.shutdown("the API server process is gone")
            break
    thread.join(timeout=30)
    beating.set()
    if recording:
        memory_history.write_and_summarise()
    core.close()
    failed = core.scheduler is not None and not core.scheduler.stopped
    time.sleep(0.1)  # let the last outputs leave the socket
    sockets.close()
    ctx.term()
    raise SystemExit(1 if failed else 0)


def _send_heartbeats(
    core: EngineCore, publish: Callable[[EngineMessage], None], stop: threading.Event
) -> None:
    scheduler = core.scheduler
    assert scheduler is not None
    last_load, last_tick = scheduler.load, time.monotonic()
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        load, now = scheduler.load, time.monotonic()
        if load is not last_load:
            last_load, last_tick = load, now
        try:
            publish(Heartbeat(stalled_s=now - last_tick, load=load))
        except zmq.ZMQError:  # the socket closed: the process is exiting
            return
