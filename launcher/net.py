"""Ports on this host: a free one for a child to listen on, and a check that a given one is free."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1", avoid: int | None = None) -> int:
    """A port nothing listens on now (the caller binds it soon after: a small race, as everywhere),
    never `avoid` (a port chosen but not bound yet, e.g. the server's own --port)."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port != avoid:
            return port


def check_port_free(host: str, port: int) -> None:
    """Bind as uvicorn will (SO_REUSEADDR), so a busy port fails before any model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e} "
                             f"(is another server running?)") from None
