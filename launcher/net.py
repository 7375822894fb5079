"""Ports on this host: a check that a given one is free (a free one: srt.utils.free_port)."""

from __future__ import annotations

import socket


def check_port_free(host: str, port: int) -> None:
    """Bind as uvicorn will (SO_REUSEADDR), so a busy port fails before any model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(
                f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e} "
                f"(is another server running?)"
            ) from None
