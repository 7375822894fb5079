"""Node 0's /metrics shows the ranks of every node: each other node's launcher publishes its ranks'
series (Prometheus text rendered from its own metric files, srt/metrics.py) in the rendezvous
store every RELAY_S, and node 0 reads them when /metrics is scraped. No new port, no message or
collective among the ranks; a node that stops publishing leaves its last values (its
`srt:last_forward_step_timestamp_seconds` goes stale, as a stuck rank's does)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from launcher.layout import RendezvousAddress
from launcher.rendezvous import connect_store, key_prefix

logger = logging.getLogger(__name__)

RELAY_S = 1.0
CONNECT_TIMEOUT_S = 10.0


def _key(node_rank: int) -> str:
    return key_prefix() + f"metrics/{node_rank}"


class MetricsRelay:
    """On a node > 0: publishes `render()` every RELAY_S until stopped (its own store client)."""

    def __init__(self, address: RendezvousAddress, node_rank: int, render: Callable[[], bytes]) -> None:
        self.address = address
        self.node_rank = node_rank
        self.render = render
        self._stop = threading.Event()

    def start(self) -> MetricsRelay:
        threading.Thread(target=self._run, name="srt-metrics-relay", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = connect_store(self.address, CONNECT_TIMEOUT_S)
            while not self._stop.is_set():
                store.set(_key(self.node_rank), self.render())
                self._stop.wait(RELAY_S)
        except Exception as error:  # the store (node 0) is gone: the node goes down on its own
            if not self._stop.is_set():
                logger.warning("metrics relay stopped: %s", error)


class RemoteMetrics:
    """On node 0: what the other nodes published last (Prometheus text each)."""

    def __init__(self, address: RendezvousAddress, nnodes: int) -> None:
        self.address = address
        self.nnodes = nnodes
        self._store: Any = None
        self._lock = threading.Lock()

    def texts(self) -> list[str]:
        with self._lock:
            if self._store is None:
                self._store = connect_store(self.address, CONNECT_TIMEOUT_S)
            out = []
            for node in range(1, self.nnodes):
                key = _key(node)
                if self._store.check([key]):
                    out.append(bytes(self._store.get(key)).decode())
            return out
