"""Surviving a lost rank (--restart-on-failure N, --restart-window S): restart the engine, replay.

When a scheduler rank or the detokenizer exits for any reason (a signal, an exception, the hard
watchdog, the consensus checker), the Supervisor asks `EngineRestarter.restart` before taking the
server down. Fewer than N restarts within the last S seconds: the restart goes ahead, in the
Supervisor's thread, which lives as long as the server (the children's parent-death signal is
tied to the thread that spawned them):

1. the front end holds new requests back and /health says 503 (FrontendRecovery.begin, the
   TokenizerManager's restart half, srt/frontend_recovery.py);
2. every child of the engine is killed, then the front end's sockets are replaced, so nothing the
   old processes sent late is read and nothing queued for the old rank 0 reaches the new one;
3. the children start again, with ENGINE_START_ENV telling them which start this is: the ranks
   meet on the rendezvous store under that start's key prefix (the dead ranks' gloo keys stay
   under the old one), and fault injection fires in the starts it names;
4. the front end replays every request in flight with the output ids its client already has
   (FrontendRecovery.resume): sampling is a pure function of (seed, output position) and the
   front end resolved every request's seed, so greedy, seeded and unseeded requests all continue
   with exactly the tokens they would have produced, and the restarted detokenizer continues each
   text where the client's ends.

A restart whose start-up fails counts as a restart too. With no restart left the Supervisor
fails loudly, as without the flag: every request gets a 503 and the server exits 1.

With --nnodes > 1 every node restarts its children, node 0 deciding for all (EngineRestarter and
launcher/peers.py): any node's lost child ends that start on every node, and node 0 alone keeps
the budget, publishes each start it begins, and replays. Every wait of another node is bounded
(--dist-timeout), and node 0's spent budget takes every node down, naming it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from srt.utils import ENGINE_START_ENV

if TYPE_CHECKING:
    from launcher.peers import PeerWatch
    from launcher.process import ChildProcess
    from srt.server_args import ServerArgs
    from srt.tokenizer_manager import TokenizerManager

logger = logging.getLogger("srt.recovery")

LOOP_CALL_TIMEOUT_S = 10.0

# Exit codes that say why a rank went (scheduler/watchdog.py, consensus/checker.py, fault injection).
EXIT_CAUSES = {
    75: "its hard watchdog fired",
    70: "the rank consensus checker found the ranks diverging",
    13: "fault injection: crash",
    1: "it raised an exception (its traceback is logged above)",
}


def failure_cause(exitcode: int | None) -> str | None:
    return EXIT_CAUSES.get(exitcode) if exitcode is not None else None


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds."""

    def __init__(
        self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.times: deque[float] = deque()

    def in_window(self) -> int:
        now = self.clock()
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        return len(self.times)

    def take(self) -> bool:
        """Use one restart if one is left (and say so); False when the budget is spent."""
        if self.in_window() >= self.max_restarts:
            return False
        self.times.append(self.clock())
        return True

    def describe(self) -> str:
        return f"restart {len(self.times)} of at most {self.max_restarts} within {self.window_s:g} s"


class EngineRestarter:
    """The Supervisor's restart hook. `start_engine()` spawns every child of this node and waits
    until all are ready (raising LaunchError otherwise); `frontend()` is the
    TokenizerManager once serving (None before, and on nodes other than 0).

    With --nnodes > 1 (`peers`) the nodes restart together and node 0 decides: it takes the
    restart from its budget and publishes the start it begins, whichever node lost a child;
    another node asks node 0 (its own child died, or its start failed) and restarts its children
    as the start node 0 publishes, or goes down when node 0 begins none within --dist-timeout.
    """

    def __init__(
        self,
        server_args: ServerArgs,
        start_engine: Callable[[], list[ChildProcess]],
        frontend: Callable[[], TokenizerManager | None],
        peers: PeerWatch | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.start_engine = start_engine
        self.frontend = frontend
        self.budget = RestartBudget(server_args.restart_on_failure, server_args.restart_window, clock)
        self.leads = server_args.node_rank == 0
        self.peers = peers if server_args.nnodes > 1 else None
        self.follow_timeout_s = server_args.dist_timeout
        self.starts = 0  # engine starts after the first
        self._lock = threading.Lock()

    def restart(
        self, message: str, dead: ChildProcess | None, children: list[ChildProcess]
    ) -> list[ChildProcess] | None:
        """`dead` (one of `children`) exited, or (None) another node's restart needs this node's:
        restart the engine if the budget allows. Returns the new children, or None (after logging
        why) when the server must go down."""
        with self._lock:
            began = time.monotonic()
            cause = failure_cause(dead.process.exitcode) if dead is not None else None
            what = f"{message} ({cause})" if cause else message
            error = dead.read_error() if dead is not None else None
            if dead is not None and error is not None:
                logger.critical("%s failed with:\n%s", dead.label, error)
            from launcher.process import LaunchError

            while True:
                start = self._next_start(what)
                if start is None:
                    return None
                try:
                    children = self._restart_once(what, children, start)
                except LaunchError as error:
                    what = f"the restarted engine failed to start: {error}"
                    continue
                break
            replayed = self._on_loop(lambda tm: tm.recovery.resume()) or 0
            seconds = time.monotonic() - began
            self._on_loop(
                lambda tm: tm.metrics.on_restart(replayed, seconds) if tm.metrics is not None else None
            )
            logger.warning(
                "engine restarted in %.1f s (start %d); replayed %d request(s) in flight",
                seconds,
                self.starts,
                replayed,
            )
            return children

    def _next_start(self, what: str) -> int | None:
        """The engine start to begin after `what`, or None (logged) when there is none."""
        peers = self.peers
        if peers is not None and peers.failure is not None:
            logger.critical("%s; no restart: %s", what, peers.failure)
            return None
        if not self.leads:
            assert peers is not None
            logger.critical("%s; waiting for node 0 to restart the engine", what)
            start = peers.await_start(what, self.follow_timeout_s)
            if isinstance(start, str):
                logger.critical("%s; no restart: %s", what, start)
                return None
            logger.warning("node 0 began engine start %d; restarting this node's ranks", start)
            return start
        if not self.budget.take():
            spent = (
                f"no restart left ({self.budget.in_window()} within the last {self.budget.window_s:g} s, "
                f"--restart-on-failure {self.budget.max_restarts})"
            )
            logger.critical("%s; %s", what, spent)
            if peers is not None:  # the others wait for node 0's next start: tell them there is none
                peers.announce(f"{what}; {spent}")
            return None
        logger.critical("%s; restarting the engine (%s)", what, self.budget.describe())
        if peers is not None:
            peers.begin_start(self.starts + 1, what)
        return self.starts + 1

    def _restart_once(self, reason: str, children: list[ChildProcess], start: int) -> list[ChildProcess]:
        """Stop every child, then start them again as engine start `start`: the ranks meet on the
        same store under that start's key prefix (scheduler/entry.py), away from the dead ranks' keys."""
        from launcher.process import stop_children

        self.starts = start
        if self.peers is not None:
            self.peers.enter(start)
        self._on_loop(lambda tm: tm.recovery.begin(reason))
        stop_children(children)
        self._on_loop_async(lambda tm: tm.reset_channels())
        os.environ[ENGINE_START_ENV] = str(start)
        return self.start_engine()

    def _on_loop(self, fn: Callable[[TokenizerManager], Any]) -> Any:
        """fn(tm) on the front end's event loop (or here, when it is not serving yet)."""
        tm = self.frontend()
        if tm is None:
            return None
        loop = tm.loop
        if loop is None or not loop.is_running():
            return fn(tm)

        async def call() -> Any:
            return fn(tm)

        return asyncio.run_coroutine_threadsafe(call(), loop).result(LOOP_CALL_TIMEOUT_S)

    def _on_loop_async(self, fn: Callable[[TokenizerManager], Coroutine[Any, Any, None]]) -> None:
        tm = self.frontend()
        if tm is None or tm.loop is None or not tm.loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(fn(tm), tm.loop).result(LOOP_CALL_TIMEOUT_S)
