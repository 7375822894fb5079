"""Where the nodes of one server meet: a torch.distributed TCPStore at --dist-init-addr.

Node 0's launcher hosts the store before any rank starts; every node's launcher then, in order,

    1. connects (plain TCP first, so an unreachable address fails quietly within --dist-timeout),
    2. claims `node/<node rank>` with compare_set (a second node with that rank is refused at once),
    3. publishes its launch fingerprint and compares it with node 0's (the differing fields are
       named on both sides), and node 0 publishes one verdict once every node has joined; a refusal
       keeps node 0's store up (at most LINGER_S) until every other node has read it.

The ranks then join torch.distributed on the same store as clients: TORCHELASTIC_USE_AGENT_STORE
is torch's own switch for "an agent process hosts the store" (torchrun's), and the launcher is
that agent. So a run needs one address and one port. Under torchrun the agent already hosts the
store at MASTER_ADDR:MASTER_PORT (`--dist-init-addr env://`) and node 0's launcher is a client.
A single-node server goes through the same steps alone. Afterwards the launchers keep using the
store to learn about each other (launcher/peers.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from launcher.fingerprint import fingerprint_diff
from launcher.layout import RendezvousAddress
from launcher.process import LaunchError

logger = logging.getLogger(__name__)

USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
POLL_S = 0.1
PROBE_S = 2.0  # how long a busy port is asked whether an srt rendezvous lives behind it
OP_TIMEOUT_S = 2.0  # after start-up, a store call that takes longer means node 0 is unreachable
LINGER_S = 5.0  # node 0 keeps a failed rendezvous's store up this long for the others to read why


class RendezvousError(LaunchError):
    """The nodes could not meet, or met and disagree; the message names the flag, address or fields."""


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def key_prefix() -> str:
    """Keys of this launch: a torchrun restart reuses the agent's store, so the attempt is part of it."""
    return f"srt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def host_store(address: RendezvousAddress) -> Any:
    """Node 0: listen on the port (all interfaces). A busy port fails at once, naming what holds it."""
    from torch.distributed import DistNetworkError, TCPStore

    try:  # the hosting object's own client connection goes over loopback
        return TCPStore("127.0.0.1", address.port, is_master=True, wait_for_workers=False)
    except DistNetworkError as error:
        if "EADDRINUSE" not in str(error):
            raise RendezvousError(f"cannot host the rendezvous at {address}: {error}") from None
    holder = _node0_holder(address)
    if holder is not None:
        raise RendezvousError(
            f"--node-rank 0 is already taken by {holder}, which hosts the rendezvous at "
            f"{address}; every node needs its own --node-rank"
        )
    raise RendezvousError(
        f"cannot host the rendezvous at {address}: port {address.port} is already in use on "
        f"this host (another server, or another program, holds it)"
    )


def _node0_holder(address: RendezvousAddress) -> str | None:
    """Who registered as node 0 there, when an srt rendezvous answers within PROBE_S."""
    try:
        store = connect_store(address, PROBE_S)
        key = key_prefix() + "node/0"
        return describe_holder(store.get(key)) if store.check([key]) else None
    except (RendezvousError, RuntimeError):
        return None


def connect_store(address: RendezvousAddress, timeout_s: float) -> Any:
    """A client of the store at `address`, or RendezvousError naming it once timeout_s passed.

    A refused or unroutable address is retried with plain sockets (torch's own connect loop retries
    past its timeout and logs every try); the store handshake then runs in a thread, because a
    port that accepts but is no TCPStore would block it for good."""
    from torch.distributed import TCPStore

    host, port, where = address.host, address.port, str(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(
                (host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))
            ).close()
            break
        except OSError as error:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"cannot reach the rendezvous at {where} within --dist-timeout {timeout_s:g} s "
                    f"({error.strerror or error}); is node 0 running there?"
                ) from None
            time.sleep(POLL_S)
    result: list[Any] = []

    def connect() -> None:
        try:
            result.append(TCPStore(host, port, is_master=False, timeout=_timedelta(max(1.0, timeout_s))))
        except Exception as error:  # handed to the caller below
            result.append(error)

    thread = threading.Thread(target=connect, name="srt-rendezvous-connect", daemon=True)
    thread.start()
    thread.join(max(1.0, deadline - time.monotonic()))
    if not result:
        raise RendezvousError(
            f"{where} accepts connections but does not answer as a torch.distributed store "
            f"within --dist-timeout {timeout_s:g} s; is it the right port?"
        )
    if isinstance(result[0], Exception):
        raise RendezvousError(f"cannot join the rendezvous at {where}: {result[0]}")
    return result[0]


def describe_holder(raw: bytes) -> str:
    holder = json.loads(raw)
    return f"the node on host {holder['host']} (pid {holder['pid']})"


class Rendezvous:
    """This node's place at the rendezvous, from the handshake until the process exits."""

    def __init__(
        self, store: Any, server: Any, node_rank: int, nnodes: int, address: RendezvousAddress
    ) -> None:
        self.store = store  # a client, on every node
        self.server = server  # node 0's hosted store (None elsewhere, or under an agent): kept alive
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.where = str(address)  # "--dist-init-addr 10.0.0.1:5000", as messages name it
        self.prefix = key_prefix()

    @classmethod
    def join(
        cls,
        address: RendezvousAddress,
        node_rank: int,
        nnodes: int,
        fingerprint: dict[str, str],
        timeout_s: float,
    ) -> Rendezvous:
        """Meet every other node, or raise RendezvousError within about timeout_s."""
        deadline = time.monotonic() + timeout_s
        agent_hosts = address.from_environment and os.environ.get(USE_AGENT_STORE) == "True"  # torchrun's
        server = host_store(address) if node_rank == 0 and not agent_hosts else None
        node = cls(connect_store(address, timeout_s), server, node_rank, nnodes, address)
        node._claim_node_rank()
        node._agree(fingerprint, deadline, timeout_s)
        node.store.set_timeout(_timedelta(OP_TIMEOUT_S))
        logger.info("node %d of %d met the others at %s", node_rank, nnodes, address)
        return node

    def key(self, name: str) -> str:
        return self.prefix + name

    def publish(self, name: str, value: str) -> None:
        self.store.set(self.key(f"shared/{name}"), value)

    def read(self, name: str, timeout_s: float) -> str:
        """What another node published under `name`; RendezvousError after timeout_s."""
        if self.wait_for([f"shared/{name}"], time.monotonic() + timeout_s):
            raise RendezvousError(f"no node published {name!r} at {self.where} within {timeout_s:g} s")
        return bytes(self.store.get(self.key(f"shared/{name}"))).decode()

    def _claim_node_rank(self) -> None:
        token = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "nonce": uuid.uuid4().hex})
        current = self.store.compare_set(self.key(f"node/{self.node_rank}"), "", token)
        if current.decode() != token:
            raise RendezvousError(
                f"--node-rank {self.node_rank} is already taken by {describe_holder(current)} "
                f"at {self.where}; every node needs its own --node-rank in [0, --nnodes "
                f"{self.nnodes})"
            )

    def wait_for(self, keys: list[str], deadline: float) -> list[str]:
        """Polls (store.wait logs every timeout); returns the keys still missing at the deadline."""
        while True:
            missing = [k for k in keys if not self.store.check([self.key(k)])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(POLL_S)

    def _agree(self, fingerprint: dict[str, str], deadline: float, timeout_s: float) -> None:
        self.store.set(self.key(f"fingerprint/{self.node_rank}"), json.dumps(fingerprint))
        if self.node_rank == 0:
            verdict = self._judge(fingerprint, deadline, timeout_s)
            self.store.set(self.key("verdict"), verdict)
            if verdict != "ok":  # the store dies with this process: let the others read the verdict first
                self.wait_for([f"seen/{k}" for k in range(1, self.nnodes)], time.monotonic() + LINGER_S)
        else:
            try:
                verdict = self._hear_verdict(fingerprint, deadline, timeout_s)
            except RendezvousError:
                raise
            except Exception as error:  # the store went away: node 0 exited during the handshake
                raise RendezvousError(
                    f"node 0 left the rendezvous at {self.where} during the start-up "
                    f"handshake ({error}); its log says why"
                ) from error
        if verdict != "ok":
            raise RendezvousError(verdict)

    def _judge(self, fingerprint: dict[str, str], deadline: float, timeout_s: float) -> str:
        """Node 0: "ok" once every node joined with the same configuration, else what went wrong."""
        missing = self.wait_for([f"fingerprint/{k}" for k in range(1, self.nnodes)], deadline)
        if missing:
            nodes = ", ".join(k.split("/")[1] for k in missing)
            return (
                f"node {nodes} did not join the rendezvous at {self.where} within --dist-timeout "
                f"{timeout_s:g} s (started with the same --dist-init-addr and --nnodes {self.nnodes}?)"
            )
        diffs = [d for k in range(1, self.nnodes) for d in self._diff_with(fingerprint, k)]
        return self._mismatch(diffs) if diffs else "ok"

    def _hear_verdict(self, fingerprint: dict[str, str], deadline: float, timeout_s: float) -> str:
        """Another node: compare with node 0's configuration, then read node 0's verdict and say so."""
        if self.wait_for(["fingerprint/0"], deadline):
            raise RendezvousError(
                f"node 0 did not publish its configuration at {self.where} within "
                f"--dist-timeout {timeout_s:g} s"
            )
        node0 = json.loads(self.store.get(self.key("fingerprint/0")))
        diffs = fingerprint_diff(node0, fingerprint, 0, self.node_rank)
        if self.wait_for(["verdict"], deadline):
            raise RendezvousError(
                f"node 0 did not answer at {self.where} within --dist-timeout {timeout_s:g} s"
            )
        verdict = self.store.get(self.key("verdict")).decode()
        self.store.set(self.key(f"seen/{self.node_rank}"), "1")
        return self._mismatch(diffs) if diffs else verdict

    def _diff_with(self, mine: dict[str, str], node: int) -> list[str]:
        return fingerprint_diff(mine, json.loads(self.store.get(self.key(f"fingerprint/{node}"))), 0, node)

    @staticmethod
    def _mismatch(diffs: list[str]) -> str:
        return (
            "the nodes were started differently (every node needs the same model, sizes, dtype, page size "
            "and version); they differ in " + "; ".join(diffs)
        )
