"""Small utilities every process may need: a free port, the torch dtype of --dtype, the CPUs this
process may use. The bottom of srt/ (pyproject.toml, [tool.importlinter]): nothing here imports
another srt module, and torch is imported only where a dtype is asked for, so the launcher stays
torch-free."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's: one CPU range per rank, "0-1|2-3" (rank_cpus)
ENGINE_START_ENV = "SRT_ENGINE_START"  # 0 for the first start, n after the n-th restart (srt/recovery.py)

# --dtype names (and the short forms the offline Engine takes) -> torch attribute names
DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


# Ports free_port draws from: from here to the kernel's ephemeral range (where that starts above it)
LOWEST_DRAWN_PORT = 10000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel gives outbound connections and bind(port 0) their local ports from."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", avoid: int | None = None) -> int:
    """A port nothing holds now, never `avoid` (a port chosen but not bound yet, e.g. the server's
    own --port). Drawn below the kernel's ephemeral range where it starts above LOWEST_DRAWN_PORT:
    until the caller binds it (a server binds its --port only once its Python has started), no
    process's outbound connection can take it, as one of gloo's or ZMQ's did in CI when these came
    from that range. Another process drawing the same port meanwhile is the race that is left."""
    low = ephemeral_ports()[0]
    draw = random.SystemRandom()
    for _ in range(100 if low > LOWEST_DRAWN_PORT + 1000 else 0):
        port = draw.randrange(LOWEST_DRAWN_PORT, low)
        if port == avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    while True:  # no room below the range, or 100 busy draws: one the kernel picks in it
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port != avoid:
            return port


def engine_start() -> int:
    """Which start of the engine this process belongs to: 0, or n after the n-th restart."""
    return int(os.environ.get(ENGINE_START_ENV, "0"))


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


def parse_cpu_binding(value: str) -> list[frozenset[int]]:
    """SGLang's SGLANG_CPU_OMP_THREADS_BIND: one CPU list per rank, '|'-separated, each a
    comma-separated list of CPUs and ranges ("0-15|16-31", "0-3,8-11|4-7,12-15").
    ValueError naming the variable where it cannot be read."""
    groups: list[frozenset[int]] = []
    for entry in value.split("|"):
        cpus: set[int] = set()
        for item in entry.split(","):
            first, dash, last = item.strip().partition("-")
            try:
                lo, hi = int(first), int(last) if dash else int(first)
            except ValueError:
                lo, hi = 0, -1
            if lo < 0 or hi < lo:
                raise ValueError(
                    f"{CPU_BIND_ENV}={value!r}: cannot read {item.strip()!r} as a CPU or a range "
                    f"of CPUs (the format is one list per rank, '|'-separated, e.g. 0-1|2-3)"
                )
            cpus.update(range(lo, hi + 1))
        groups.append(frozenset(cpus))
    return groups


def rank_cpus(
    local_ranks: int, cpu_threads: int | None = None, environ: Mapping[str, str] = os.environ
) -> list[tuple[int, frozenset[int] | None]]:
    """(torch threads, CPUs to pin to or None) for each of this node's `local_ranks` ranks, in
    order. --cpu-threads N gives every rank N threads; SGLANG_CPU_OMP_THREADS_BIND pins each rank
    to its range and, without --cpu-threads, gives it one thread per CPU of that range; neither:
    the usable CPUs shared out (threads_per_rank), nothing pinned. ValueError naming the variable
    where its ranges do not match the ranks or name CPUs this process may not use."""
    value = environ.get(CPU_BIND_ENV, "").strip()
    if not value:
        threads = cpu_threads if cpu_threads is not None else threads_per_rank(local_ranks)
        return [(threads, None)] * local_ranks
    groups = parse_cpu_binding(value)
    if len(groups) != local_ranks:
        raise ValueError(
            f"{CPU_BIND_ENV}={value!r} has {len(groups)} CPU range(s) for the {local_ranks} rank(s) "
            f"on this node; give one per rank, '|'-separated"
        )
    try:
        allowed: set[int] | None = set(os.sched_getaffinity(0))
    except AttributeError:
        allowed = None
    for group in groups:
        if allowed is not None and not group <= allowed:
            raise ValueError(
                f"{CPU_BIND_ENV}={value!r} names CPU(s) {sorted(group - allowed)} this process "
                f"may not run on (it may use {sorted(allowed)})"
            )
    return [(cpu_threads if cpu_threads is not None else len(group), group) for group in groups]
