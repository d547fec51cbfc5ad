"""A client that leaves mid-stream does not fill the server log: asyncio's 'socket.send() raised
exception.' line (one per write to a connection already lost) is dropped."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import pytest

from deltaserve.server.lifecycle import quiet_writes_to_gone_clients

NOISE = "socket.send() raised exception."


async def _write_after_the_client_reset(writes: int) -> None:
    reset = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reset.wait()
        await asyncio.sleep(0.1)  # the reset has arrived
        for _ in range(writes):
            writer.write(b"data: {}\n\n" * 1000)
            await asyncio.sleep(0)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # RST
    reset.set()
    await asyncio.sleep(0.5)
    server.close()
    await server.wait_closed()


def _noise(caplog: pytest.LogCaptureFixture) -> int:
    return sum(record.getMessage() == NOISE for record in caplog.records)


def test_writes_to_a_client_that_reset_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    asyncio_logger = logging.getLogger("asyncio")
    filters = list(asyncio_logger.filters)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            asyncio.run(_write_after_the_client_reset(20))
            assert _noise(caplog) > 0, "asyncio no longer logs writes to a lost connection"
            caplog.clear()
            quiet_writes_to_gone_clients()
            asyncio.run(_write_after_the_client_reset(20))
            assert _noise(caplog) == 0
    finally:
        asyncio_logger.filters[:] = filters
