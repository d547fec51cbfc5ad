"""The server's listening socket, bound before anything slow starts (light: `deltaserve serve` binds it
before importing the server), so a taken port fails at once."""

from __future__ import annotations

import socket

from deltaserve.errors import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host"
        ) from exc
    return sock
