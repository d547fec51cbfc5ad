"""The server's listening socket, bound before anything slow starts (light: `deltaserve serve` binds it
before importing the server), so a taken port fails at once.

The socket is made with proto=IPPROTO_TCP: accepted connections inherit it, and asyncio turns Nagle's
algorithm off (TCP_NODELAY) only on sockets whose proto says TCP. With proto 0 a streamed chunk written
after the response headers waits for the client's delayed ACK (~40 ms on Linux) before it leaves."""

from __future__ import annotations

import socket

from deltaserve.errors import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host"
        ) from exc
    return sock
