"""The listening socket: connections the server's event loop accepts on it have Nagle's algorithm off."""

from __future__ import annotations

import asyncio
import socket

import pytest

from deltaserve.errors import ConfigError
from deltaserve.server.listen import bind_socket


def test_accepted_connections_have_tcp_nodelay() -> None:
    """uvicorn serves a pre-bound socket through loop.create_server(sock=...); asyncio sets TCP_NODELAY
    on what it accepts only when the socket's proto is IPPROTO_TCP. Without it the first streamed chunk
    of a short request waits ~40 ms for the client's delayed ACK."""

    async def accepted_nodelay() -> int:
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 5.0)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0


def test_a_taken_port_names_the_address_and_the_flags() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.1:{port}.*--port or --host"):
            bind_socket("127.0.0.1", port)
