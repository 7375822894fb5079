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

With --restart-on-failure the nodes restart together (srt/recovery.py), node 0 deciding: another
node whose engine start ended asks for the next (key `wanted/<node>`) and waits, bounded, until
node 0 begins it (`await_start`); node 0 publishes every start it begins (`begin_start`, key
`engine`). `restarts` wakes a Supervisor whose own children are still running: on node 0 when
another node asks, on the others when node 0 began a start they have not joined.
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
    def __init__(self, rendezvous: Rendezvous, report_lost: bool = False) -> None:
        self.rdzv = rendezvous
        # A node silent for LOST_AFTER_S is reported on `failures` too (with --restart-on-failure:
        # node 0 would otherwise restart and wait --dist-timeout for ranks that cannot come).
        self.report_lost = report_lost
        self._last_beats: dict[int, tuple[int, float]] = {}
        self.others = [k for k in range(rendezvous.nnodes) if k != rendezvous.node_rank]
        # One message, "node 1 went down (...)", when another node publishes its failure.
        self.failures, self._failure_writer = Pipe(duplex=False)
        self._stop = threading.Event()
        self._seq: int | None = None  # this node's place among the published failures
        self.leader_stopped = False  # node 0 went down because it was asked to (set before `failures` fires)
        self.failure: str | None = None  # the message `failures` carries (set before it fires)
        # One message per engine start this node's Supervisor must join ("node 1 asks ...").
        self.restarts, self._restart_writer = Pipe(duplex=False)
        self.engine_start = 0  # the engine start this node's children belong to (srt/recovery.py)
        self._restart_lock = threading.Lock()
        self._signalled: set[str] = set()

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
                    self.failure = f"node {node} went down ({text})"
                    self._failure_writer.send(self.failure)
                    return
                lost = self._lost() if self.report_lost else None
                if lost is not None and not self._stop.is_set():
                    self.failure = lost
                    self._failure_writer.send(lost)
                    return
                self._check_restarts()
            except RuntimeError:  # the store is gone: our ranks notice too, and explain() says why
                return
            self._stop.wait(HEARTBEAT_S)

    def _check_restarts(self) -> None:
        """Wake the Supervisor once for each engine start after this node's that another node needs:
        on node 0 one that another node asks for, elsewhere one that node 0 began."""
        if self.rdzv.node_rank == 0:
            found = [(self._read(f"wanted/{k}"), f"node {k} asks for a restart") for k in self.others]
        else:
            found = [(self._read("engine"), "node 0 restarts the engine")]
        with self._restart_lock:
            for value, who in found:
                if value is None or value in self._signalled:
                    continue
                if _start_of(value) > self.engine_start:
                    _, _, reason = value.partition(" ")
                    self._signalled.add(value)
                    self._restart_writer.send(f"{who} ({reason})")

    def _lost(self) -> str | None:
        """The first other node whose heartbeat has not moved for LOST_AFTER_S."""
        now = time.monotonic()
        for k, count in self._beats().items():
            if self._last_beats.get(k, (-1, 0.0))[0] != count:
                self._last_beats[k] = (count, now)
            elif now - self._last_beats[k][1] >= LOST_AFTER_S:
                return _gone(k)
        return None

    def _read(self, name: str) -> str | None:
        key = self.rdzv.key(name)
        return bytes(self.rdzv.store.get(key)).decode() if self.rdzv.store.check([key]) else None

    def enter(self, engine_start: int) -> None:
        """This node's children are about to start as `engine_start`: restart requests for earlier
        starts are stale now, also those already waiting in `restarts`."""
        with self._restart_lock:
            self.engine_start = engine_start
            while self.restarts.poll():
                self.restarts.recv()

    def begin_start(self, engine_start: int, reason: str) -> None:
        """Node 0: every node restarts its children as `engine_start` (this node's children next)."""
        try:
            self.rdzv.store.set(self.rdzv.key("engine"), f"{engine_start} {reason}")
        except RuntimeError as error:  # the others then wait for it in vain, and go down when that ends
            logger.error("cannot tell the other nodes about engine start %d: %s", engine_start, error)

    def await_start(self, reason: str, timeout_s: float) -> int | str:
        """Another node: ask node 0 for an engine start after this node's (`reason`: why this one
        ended), and wait for it. Returns it, or why there is none: a node went down, node 0 is gone,
        or timeout_s passed without one."""
        deadline = time.monotonic() + timeout_s
        wanted = f"{self.engine_start + 1} {reason}"
        try:
            self.rdzv.store.set(self.rdzv.key(f"wanted/{self.rdzv.node_rank}"), wanted)
            while self.failure is None:
                value = self._read("engine")
                if value is not None and _start_of(value) > self.engine_start:
                    return _start_of(value)
                if time.monotonic() >= deadline:
                    return f"node 0 began no engine start within --dist-timeout {timeout_s:g} s"
                time.sleep(POLL_S)
        except RuntimeError:  # torch's DistError: the store (node 0's launcher) stopped answering
            return self._store_gone()
        return self.failure

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
        if not self.others or self._seq is not None:  # none, or this node already published why it goes
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
                    return "; ".join(_gone(k) for k in silent)
                time.sleep(POLL_S)
        except RuntimeError as error:  # torch's DistError: the store (node 0's launcher) stopped answering
            logger.debug("rendezvous store unreachable: %s", error)
            return self._store_gone()

    def _store_gone(self) -> str:
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


def _start_of(value: str) -> int:
    """The engine start in a published "<start> <reason>" (keys `engine`, `wanted/<node>`)."""
    return int(value.partition(" ")[0])


def _gone(node: int) -> str:
    return f"node {node} is gone (no heartbeat for {LOST_AFTER_S:g} s)"
