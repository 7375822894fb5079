"""Rank layout: which tensor/pipeline ranks a node runs, and where the ranks meet.

World ranks are numbered TP-fastest and dealt to nodes in contiguous blocks:

    world_rank = tp_size * pp_rank + tp_rank          (tp=2, pp=2, nnodes=2)
    node 0: world 0 (PP0 TP0), world 1 (PP0 TP1)      <- input rank = world 0
    node 1: world 2 (PP1 TP0), world 3 (PP1 TP1)      <- output rank = TP0 of the last stage

Pure arithmetic: nothing here touches processes, sockets or devices (except the free port that
`resolve_init_method` picks for a single-node run); callers pass in the environment and the
device count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from srt.utils import free_port

INPUT_WORLD_RANK = 0  # owns the front end's ZMQ socket and broadcasts what it receives


def output_world_rank(tp_size: int, pp_size: int) -> int:
    """TP rank 0 of the last pipeline stage: the one rank that streams tokens to the detokenizer."""
    return tp_size * (pp_size - 1)


@dataclass(frozen=True)
class RankInfo:
    """Everything a scheduler process needs to know about its own place in the world."""

    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    node_rank: int
    nnodes: int
    local_index: int  # position among this node's ranks: 0 .. local_world_size - 1
    local_world_size: int  # scheduler ranks on this node
    device_type: str  # "cpu" | "cuda"

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size
        assert 0 <= self.node_rank < self.nnodes and 0 <= self.local_index < self.local_world_size
        assert self.world_rank == self.node_rank * self.local_world_size + self.local_index

    @property
    def world_rank(self) -> int:
        return self.tp_size * self.pp_rank + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def device_id(self) -> int | None:
        """CUDA ordinal on this node (one device per local rank); None on CPU."""
        return self.local_index if self.device_type == "cuda" else None

    @property
    def device(self) -> str:
        return "cpu" if self.device_id is None else f"cuda:{self.device_id}"

    @property
    def is_input_rank(self) -> bool:
        return self.world_rank == INPUT_WORLD_RANK

    @property
    def is_output_rank(self) -> bool:
        return self.world_rank == output_world_rank(self.tp_size, self.pp_size)

    @property
    def suffix(self) -> str:
        ranks = f"PP{self.pp_rank}_TP{self.tp_rank}" if self.pp_size > 1 else f"TP{self.tp_rank}"
        replica = dp_rank_label()
        return f"{replica}_{ranks}" if replica else ranks

    @property
    def title(self) -> str:
        """Process title, as `ps`, `top` and py-spy show it."""
        return f"srt::scheduler_{self.suffix}"

    @property
    def name(self) -> str:
        """How log and error messages name this rank."""
        return f"scheduler {self.suffix.replace('_', ' ')}"


DP_RANK_ENV = (
    "SRT_DP_RANK"  # set by --dp-size's controller in each replica's environment (launcher/data_parallel.py)
)


def dp_rank_label() -> str:
    """ "DP1" in replica 1 of a --dp-size server (its process titles and log labels say so), else ""."""
    rank = os.environ.get(DP_RANK_ENV, "")
    return f"DP{rank}" if rank.isdigit() else ""


def node_of_world_rank(world_rank: int, world_size: int, nnodes: int) -> int:
    return world_rank // (world_size // nnodes)


def local_ranks(
    tp_size: int, pp_size: int, nnodes: int = 1, node_rank: int = 0, device_type: str = "cpu"
) -> list[RankInfo]:
    """The ranks node `node_rank` runs, in world-rank order. Raises ValueError on a bad layout."""
    for flag, value in (("--tp-size", tp_size), ("--pp-size", pp_size), ("--nnodes", nnodes)):
        if value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    world_size = tp_size * pp_size
    if world_size % nnodes != 0:
        raise ValueError(
            f"--tp-size x --pp-size ({tp_size} x {pp_size}) is not divisible by --nnodes {nnodes}"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is outside [0, --nnodes {nnodes})")
    per_node = world_size // nnodes
    first = node_rank * per_node
    return [
        RankInfo(
            tp_rank=w % tp_size,
            pp_rank=w // tp_size,
            tp_size=tp_size,
            pp_size=pp_size,
            node_rank=node_rank,
            nnodes=nnodes,
            local_index=w - first,
            local_world_size=per_node,
            device_type=device_type,
        )
        for w in range(first, first + per_node)
    ]


def resolve_init_method(dist_init_addr: str | None, nnodes: int = 1, http_port: int | None = None) -> str:
    """torch.distributed init method from `--dist-init-addr`.

    None -> a free loopback port other than `http_port` (single node only); "HOST:PORT" or "[v6]:PORT" -> tcp://...;
    "env://" and "tcp://..." pass through (an outer orchestrator owns the rendezvous).
    """
    if dist_init_addr is None or dist_init_addr == "":
        if nnodes > 1:
            raise ValueError("--dist-init-addr HOST:PORT is required when --nnodes > 1")
        return f"tcp://127.0.0.1:{free_port(avoid=http_port)}"
    if dist_init_addr == "env://" or dist_init_addr.startswith("tcp://"):
        return dist_init_addr
    host, sep, port_text = dist_init_addr.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"--dist-init-addr must be HOST:PORT (port in [1, 65535]) or env://; got {dist_init_addr!r}"
        )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # bare IPv6 address
    return f"tcp://{host}:{int(port_text)}"


def check_device_count(ranks_per_node: int, available: int, nnodes: int) -> None:
    """One CUDA device per local rank. Raises ValueError naming the remedy."""
    if ranks_per_node > available:
        raise ValueError(
            f"this node runs {ranks_per_node} ranks (--tp-size x --pp-size / --nnodes {nnodes}) but "
            f"has {available} CUDA devices; use smaller sizes or more nodes (--nnodes)"
        )


@dataclass(frozen=True)
class RendezvousAddress:
    """Where node 0's rendezvous store listens, and how the user named it (for messages)."""

    host: str
    port: int
    source: str  # "--dist-init-addr" | "MASTER_ADDR:MASTER_PORT"

    @property
    def from_environment(self) -> bool:
        return self.source == "MASTER_ADDR:MASTER_PORT"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.source} {host}:{self.port}"


def rendezvous_address(init_method: str, environ: Mapping[str, str]) -> RendezvousAddress:
    """The store behind a resolved init method: tcp://HOST:PORT, or env:// read as torch reads it."""
    if init_method.startswith("env://"):
        missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(var)]
        if missing:
            raise ValueError(f"--dist-init-addr env:// needs {' and '.join(missing)} in the environment")
        port_text = environ["MASTER_PORT"]
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(
                f"--dist-init-addr env://: MASTER_PORT must be a port in [1, 65535], got {port_text!r}"
            )
        return RendezvousAddress(environ["MASTER_ADDR"], int(port_text), "MASTER_ADDR:MASTER_PORT")
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or not parts.port:
        raise ValueError(
            f"--dist-init-addr must be HOST:PORT, tcp://HOST:PORT or env://; got {init_method!r}"
        )
    return RendezvousAddress(parts.hostname, parts.port, "--dist-init-addr")
