"""Ports on this host: the HTTP listener, bound before anything else starts (a free port:
srt.utils.free_port)."""

from __future__ import annotations

import socket


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's HTTP socket, bound as uvicorn binds (SO_REUSEADDR) and held from before any child
    starts until uvicorn serves on it: a child's ephemeral port (gloo's pairs, ZMQ) can then never
    take it. A busy port is a ValueError naming the flags."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e} (is another server running?)"
        ) from None
    return sock


def check_port_free(host: str, port: int) -> None:
    """A busy port fails before any model loads (ValueError naming the flags)."""
    bind_listener(host, port).close()
