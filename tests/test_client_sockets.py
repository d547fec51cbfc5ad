"""The engine's sockets to several API server processes (engine/client_sockets.py): each request's
outputs go back to the process that sent it, heartbeats to every process, and a finished request is
forgotten."""

from __future__ import annotations

import time

import pytest
import zmq

from deltaserve.engine.client_sockets import ClientAddress, ClientSockets
from deltaserve.engine.process import client_addresses
from deltaserve.engine.protocol import (
    AbortRequest,
    AddRequest,
    Heartbeat,
    LoadSnapshot,
    RequestUpdate,
    StepOutputs,
    decode_engine_message,
    encode_client_message,
)
from deltaserve.sampling_params import SamplingParams

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial


def _clients(ctx: zmq.Context, addresses: tuple[ClientAddress, ...]) -> list[tuple[zmq.Socket, zmq.Socket]]:
    pairs = []
    for address in addresses:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(address.input)
        pull.bind(address.output)
        pairs.append((push, pull))
    return pairs


def _receive_all(sockets: ClientSockets, count: int) -> list:
    messages, deadline = [], time.monotonic() + 10
    while len(messages) < count and time.monotonic() < deadline:
        messages += sockets.receive(100)
    return messages


def _read(pull: zmq.Socket):
    assert pull.poll(5000), "nothing arrived"
    return decode_engine_message(pull.recv())


def test_outputs_go_to_the_sender_and_heartbeats_to_everyone(tmp_path) -> None:
    ctx = zmq.Context()
    addresses = client_addresses(str(tmp_path), 2)
    assert addresses[0].input.endswith("/input") and addresses[1].output.endswith("/output-1")
    clients = _clients(ctx, addresses)
    engine = ClientSockets(ctx, addresses)
    try:
        params = SamplingParams(max_tokens=2)
        clients[0][0].send(encode_client_message(AddRequest("a", [1], params)))
        clients[1][0].send(encode_client_message(AddRequest("b", [1], params)))
        clients[1][0].send(encode_client_message(AbortRequest("c")))
        received = _receive_all(engine, 3)
        assert sorted(m.request_id for m in received) == ["a", "b", "c"]
        load = LoadSnapshot(running=2)
        engine.publish(StepOutputs([RequestUpdate("a", [5]), RequestUpdate("b", [6])], load))
        first, second = _read(clients[0][1]), _read(clients[1][1])
        assert [(u.request_id, u.new_token_ids) for u in first.updates] == [("a", [5])]
        assert [(u.request_id, u.new_token_ids) for u in second.updates] == [("b", [6])]
        assert first.load == second.load == load
        engine.publish(
            StepOutputs([RequestUpdate("b", [7], finish_reason="length")], LoadSnapshot(running=1))
        )
        assert [u.finish_reason for u in _read(clients[1][1]).updates] == ["length"]
        only_load = _read(clients[0][1])  # the step's load reaches a client without updates in it too
        assert only_load.updates == [] and only_load.load.running == 1
        assert "b" not in engine._sender and "a" in engine._sender  # a terminal forgets its sender
        engine.publish(Heartbeat(stalled_s=0.0, load=load))
        assert isinstance(_read(clients[0][1]), Heartbeat) and isinstance(_read(clients[1][1]), Heartbeat)
        assert not clients[0][1].poll(100)  # client 0 got nothing of b's
    finally:
        engine.close(0)
        for push, pull in clients:
            push.close(0)
            pull.close(0)
        ctx.term()
