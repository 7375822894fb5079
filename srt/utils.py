"""Small utilities every process may need: a free port, the torch dtype of --dtype, the CPUs this
process may use. The bottom of srt/ (pyproject.toml, [tool.importlinter]): nothing here imports
another srt module, and torch is imported only where a dtype is asked for, so the launcher stays
torch-free."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ENGINE_START_ENV = "SRT_ENGINE_START"  # 0 for the first start, n after the n-th restart (srt/recovery.py)

# --dtype names (and the short forms the offline Engine takes) -> torch attribute names
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
          "float32": "float32", "float": "float32", "fp32": "float32"}


def free_port(host: str = "127.0.0.1", avoid: int | None = None) -> int:
    """A port nothing listens on now (the caller binds it soon after: a small race, as everywhere),
    never `avoid` (a port chosen but not bound yet, e.g. the server's own --port)."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port != avoid:
            return port


def resolve_dtype(name: str, device: str) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    dtype: torch.dtype = getattr(torch, DTYPES[name])
    return dtype


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's cpuset, `taskset`), not
    the host's count, which would oversubscribe them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int:
    """torch threads for each of `local_ranks` ranks sharing this node's usable CPUs. The ranks are
    not pinned: on a 2-vCPU VM two TP ranks pinned one per vCPU served fewer tokens per second than
    floating ones (docs/performance.md), as a pinned rank cannot move off the vCPU the front end
    takes."""
    return max(1, usable_cpus() // local_ranks)
