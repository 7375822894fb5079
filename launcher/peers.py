"""What a node learns about the other nodes of its server, after the rendezvous.

A lost node shows up on the others as a rank whose collective failed ("connection reset by
peer"): true, but it does not say which node to look at. So every launcher, from the rendezvous
until it exits, beats a counter in the rendezvous store, and a node that goes down publishes why
(numbered, so the first failure is known). From those:

- a node that goes down on its own (start-up failure, dead child, a signal) is reported at once to
  the other nodes' launchers (`failures`), which go down naming it, even when their ranks are
  still waiting in a rendezvous that would otherwise only time out;
- node 0 stopped on purpose (a signal asked it to) ends the other nodes too, but as a clean exit:
  `leader_stopped` is set before the message arrives, and their launchers exit 0;
- when a child dies, `explain` says which other node went first: one that published an earlier
  failure ("node 1 went down first (...)"), one that stopped beating for LOST_AFTER_S ("node 1 is
  gone"), or node 0 when the store it hosts stops answering. Nothing, when every other node still
  beats: the failure began here.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Pipe

from launcher.rendezvous import POLL_S, Rendezvous

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.2
LOST_AFTER_S = 2.0  # generous: a launcher on a loaded machine still beats well within it


class PeerWatch:
    def __init__(self, rendezvous: Rendezvous) -> None:
        self.rdzv = rendezvous
        self.others = [k for k in range(rendezvous.nnodes) if k != rendezvous.node_rank]
        # One message, "node 1 went down (...)", when another node publishes its failure.
        self.failures, self._failure_writer = Pipe(duplex=False)
        self._stop = threading.Event()
        self._seq: int | None = None  # this node's place among the published failures
        self.leader_stopped = False  # node 0 went down because it was asked to (set before `failures` fires)

    def start(self) -> PeerWatch:
        if self.others:
            threading.Thread(target=self._watch, name="srt-peer-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        beat = self.rdzv.key(f"beat/{self.rdzv.node_rank}")
        while not self._stop.is_set():
            try:
                self.rdzv.store.add(beat, 1)
                failed = self._failures_before(None)
                if failed and not self._stop.is_set():
                    node, text = failed[0]
                    self.leader_stopped = node == 0 and self.rdzv.store.check([self.rdzv.key("stopped/0")])
                    self.rdzv.store.set(self.rdzv.key(f"heard/{self.rdzv.node_rank}"), "1")  # node 0 may go
                    self._failure_writer.send(f"node {node} went down ({text})")
                    return
            except RuntimeError:  # the store is gone: our ranks notice too, and explain() says why
                return
            self._stop.wait(HEARTBEAT_S)

    def publish(self, message: str) -> int:
        """Tell the other nodes why this one goes down (once); returns its place among failures."""
        self._stop.set()
        if self._seq is None:
            self._seq = int(self.rdzv.store.add(self.rdzv.key("failures"), 1))
            self.rdzv.store.set(self.rdzv.key(f"failure/{self.rdzv.node_rank}"), f"{self._seq} {message}")
        return self._seq

    def announce(self, message: str, deliberate: bool = False) -> None:
        """A deliberate (a signal asked for it) or start-up exit: best effort, the store may be
        gone already."""
        try:
            if deliberate:
                self.rdzv.store.set(self.rdzv.key(f"stopped/{self.rdzv.node_rank}"), "1")
            self.publish(message)
            if self.rdzv.node_rank == 0:
                self._await_heard()
        except RuntimeError:
            pass

    def _await_heard(self) -> None:
        """Node 0 hosts the store: it stays up until every other node has read why it goes down
        (or LOST_AFTER_S), so that none finds the store gone first and never learns the reason, or
        that the stop was deliberate."""
        self.rdzv.wait_for([f"heard/{k}" for k in self.others], time.monotonic() + LOST_AFTER_S)

    def explain(self, message: str) -> str | None:
        """Publish `message` (this node's first dead child), then say which other node went first,
        if one did. Takes up to LOST_AFTER_S while the others' heartbeats are checked."""
        if not self.others:
            return None
        try:
            seq = self.publish(message)
            before = self._beats()
            deadline = time.monotonic() + LOST_AFTER_S
            while True:
                earlier = self._failures_before(seq)
                if earlier:
                    return "; ".join(f"node {node} went down first ({text})" for node, text in earlier)
                silent = [k for k, n in self._beats().items() if n == before[k]]
                if not silent:
                    return None
                if time.monotonic() >= deadline:
                    return "; ".join(
                        f"node {k} is gone (no heartbeat for {LOST_AFTER_S:g} s)" for k in silent
                    )
                time.sleep(POLL_S)
        except RuntimeError as error:  # torch's DistError: the store (node 0's launcher) stopped answering
            logger.debug("rendezvous store unreachable: %s", error)
            return f"node 0 is gone (its rendezvous at {self.rdzv.where} no longer answers)"

    def _beats(self) -> dict[int, int]:
        return {k: int(self.rdzv.store.add(self.rdzv.key(f"beat/{k}"), 0)) for k in self.others}

    def _failures_before(self, seq: int | None) -> list[tuple[int, str]]:
        """Other nodes' published failures numbered below `seq` (all of them for None), oldest first."""
        found = []
        for k in self.others:
            key = self.rdzv.key(f"failure/{k}")
            if self.rdzv.store.check([key]):
                seq_text, _, text = self.rdzv.store.get(key).decode().partition(" ")
                if seq is None or int(seq_text) < seq:
                    found.append((int(seq_text), k, text))
        return [(k, text) for _, k, text in sorted(found)]
