"""The engine process's side of its API server processes' sockets (`--api-server-count N`).

Each API server process k binds a PUSH socket at `clients[k].input` (its requests) and a PULL socket at
`clients[k].output` (its outputs); the engine connects to all of them. A request's updates go back to
the process that sent it: the sender of each AddRequest is remembered until the request's terminal
update leaves. Every client gets every step's load (a step's message with none of its updates) and
every heartbeat.

With several clients an output socket queues without bound for a client that has not connected yet or
reads slowly: a full queue would block the engine's publishing, and every client with it. A client
process that dies is a server that fails closed (the main API server process shuts the engine down).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from deltaserve.engine.protocol import (
    AddRequest,
    ClientMessage,
    EngineMessage,
    StepOutputs,
    decode_client_message,
    encode_engine_message,
)


@dataclass(frozen=True, slots=True)
class ClientAddress:
    input: str  # the client's requests: it binds a PUSH socket here, the engine connects a PULL
    output: str  # its outputs: it binds a PULL socket here, the engine connects a PUSH


class ClientSockets:
    """`receive` runs on one thread (the engine process's main loop); `publish` may be called from any
    (the scheduler's and the heartbeat's), under one lock."""

    def __init__(self, ctx: zmq.Context, clients: Sequence[ClientAddress]) -> None:
        if not clients:
            raise ValueError("an engine needs at least one client")
        self._inboxes: list[zmq.Socket] = []
        self._outboxes: list[zmq.Socket] = []
        for client in clients:
            inbox = ctx.socket(zmq.PULL)
            inbox.connect(client.input)
            outbox = ctx.socket(zmq.PUSH)
            if len(clients) > 1:
                outbox.setsockopt(zmq.SNDHWM, 0)
            outbox.connect(client.output)
            self._inboxes.append(inbox)
            self._outboxes.append(outbox)
        self._poller = zmq.Poller()
        for inbox in self._inboxes:
            self._poller.register(inbox, zmq.POLLIN)
        self._sender: dict[str, int] = {}  # request id -> the client that sent it, until its terminal
        self._lock = threading.Lock()

    def receive(self, timeout_ms: int) -> list[ClientMessage]:
        """Every message waiting on any client's socket (waiting up to `timeout_ms` for the first)."""
        ready = dict(self._poller.poll(timeout=timeout_ms))
        messages: list[ClientMessage] = []
        for k, inbox in enumerate(self._inboxes):
            if not ready.get(inbox):
                continue
            while True:
                try:
                    data = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decode_client_message(data)
                if isinstance(msg, AddRequest) and len(self._outboxes) > 1:
                    self._sender[msg.request_id] = k
                messages.append(msg)
        return messages

    def publish(self, msg: EngineMessage) -> None:
        if len(self._outboxes) == 1 or not isinstance(msg, StepOutputs):
            data = encode_engine_message(msg)  # outside the lock: the other thread may send meanwhile
            with self._lock:
                for outbox in self._outboxes:
                    outbox.send(data)
            return
        with self._lock:
            for k, updates in enumerate(self._route(msg)):
                self._outboxes[k].send(encode_engine_message(StepOutputs(updates, msg.load)))

    def _route(self, msg: StepOutputs) -> list[list]:
        """Each client's updates; a client with none still gets the step's load (its /load and load
        gauges stay as fresh as the others')."""
        routed: list[list] = [[] for _ in self._outboxes]
        for update in msg.updates:
            routed[self._sender.get(update.request_id, 0)].append(update)
            if update.finished:
                self._sender.pop(update.request_id, None)
        return routed

    def close(self, output_linger_ms: int = 2000) -> None:
        for outbox in self._outboxes:
            outbox.close(linger=output_linger_ms)
        for inbox in self._inboxes:
            inbox.close(linger=0)
