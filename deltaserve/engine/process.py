"""The EngineCore in its own process, talking ZMQ + msgpack to the API server.

Sockets: the client binds a PUSH socket for requests and a PULL socket for outputs (ipc:// paths in a
private temp dir); the engine connects. Start-up reports over a pipe: ("ready", EngineInfo fields) or
("error", message). The engine exits when the scheduler stops (Shutdown message or fatal error: the
scheduler has then already sent every owned request its terminal), or when its parent dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from multiprocessing.connection import Connection

import zmq

from deltaserve.config import EngineConfig
from deltaserve.engine.protocol import StepOutputs, decode_client_message, encode_outputs
from deltaserve.errors import ConfigError

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.1


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str, ready: Connection) -> None:
    logging.basicConfig(
        level=os.environ.get("DELTASERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s engine %(levelname)s %(message)s",
    )
    parent = os.getppid()
    try:
        from deltaserve.engine.core import EngineCore

        core = EngineCore(config)
    except ConfigError as exc:  # a flag or checkpoint that cannot be served: its one-line message is all
        ready.send(("error", str(exc)))
        raise SystemExit(1) from exc
    except Exception as exc:
        logger.exception("engine failed to start")
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    send_lock = threading.Lock()

    def publish(outputs: StepOutputs) -> None:
        data = encode_outputs(outputs)
        with send_lock:
            outbox.send(data)

    core.start(publish)
    ready.send(("ready", dataclasses.asdict(core.info)))
    ready.close()
    thread = core.thread
    assert thread is not None
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while thread.is_alive():
        if dict(poller.poll(timeout=int(PARENT_POLL_S * 1000))).get(inbox):
            while True:
                try:
                    data = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                core.submit(decode_client_message(data))
        if os.getppid() != parent:
            logger.error("the API server process is gone; shutting the engine down")
            core.shutdown("the API server process is gone")
            break
    thread.join(timeout=30)
    core.close()
    failed = core.scheduler is not None and not core.scheduler.stopped
    time.sleep(0.1)  # let the last outputs leave the socket
    outbox.close(linger=2000)
    inbox.close(linger=0)
    ctx.term()
    raise SystemExit(1 if failed else 0)
