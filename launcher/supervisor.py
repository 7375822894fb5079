"""After start-up: any child that exits, for any reason, takes the whole server down, loudly.

A lost rank cannot be recovered in place: its peers are blocked in collectives that will never
complete. So the Supervisor names the dead child, lets the front end fail every in-flight
request with that message, kills the rest of the tree and exits non-zero; unless a `restart`
hook (srt/recovery.py, --restart-on-failure) replaces every child with a fresh set, which the
Supervisor then watches the same way; on a multi-node server also when another node's restart
needs this node's children restarted (`peer_restart`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe, wait

from launcher.process import ChildProcess, stop_children

logger = logging.getLogger(__name__)

# A child killed by SIGTERM: how long a deliberate shutdown that sent it (to the whole process group,
# as a service manager or `timeout` does) may take to reach stop() before the death counts as a failure
TERM_GRACE_S = 3.0


class Supervisor:
    """Watches `children` (and, on a multi-node server, the other nodes) from a daemon thread.

    On the first unexpected exit: log CRITICAL "<name> (pid N) exited with code C" (or "was
    killed by signal S"), followed by explain(message) when that names a cause elsewhere (another
    node went first), and the child's traceback if it sent one. A message arriving on
    `peer_failure` (another node published its failure) ends the server the same way. Then call
    on_failure(message); wait grace_s so the front end can flush the error responses; SIGKILL
    every child tree; call exit_fn(exit_code) (default os._exit: the main process ends non-zero).
    `stop()` before a deliberate shutdown makes later exits quiet, and so does a stop() within
    TERM_GRACE_S of a child's death by SIGTERM (a signal to the whole process group reaches the
    children before the main process has shut down). With `restart`, a child's
    exit first goes to restart(message, dead, children), run in this thread (it lives as long as
    the server, so children it spawns keep their parent-death signal): new children are watched
    from then on; None means no restart, and the server goes down as above. A message on
    `peer_restart` (another node's restart needs this node's) goes to restart(message, None,
    children) the same way.
    """

    def __init__(
        self,
        children: list[ChildProcess],
        on_failure: Callable[[str], None] | None = None,
        *,
        grace_s: float = 1.0,
        exit_code: int = 1,
        exit_fn: Callable[[int], object] = os._exit,
        explain: Callable[[str], str | None] | None = None,
        peer_failure: Connection | None = None,
        peer_restart: Connection | None = None,
        restart: Callable[[str, ChildProcess | None, list[ChildProcess]], list[ChildProcess] | None]
        | None = None,
    ) -> None:
        self.children = list(children)
        # (message, dead child or None for peer_restart, children) -> new children, or None: go down
        self.restart = restart
        self.on_failure = on_failure
        self.explain = explain
        self.peer_failure = peer_failure
        self.peer_restart = peer_restart
        self.grace_s = grace_s
        self.exit_code = exit_code
        self.exit_fn = exit_fn
        self.failure: str | None = None  # the message, once a child died unexpectedly
        self.done = threading.Event()  # set after a failure was handled (before exit_fn)
        self._lock = threading.Lock()
        self._stopping = False
        self._wake_reader, self._wake_writer = Pipe(duplex=False)
        self._thread = threading.Thread(target=self._watch, name="srt-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """A deliberate shutdown begins: exits from now on are expected."""
        with self._lock:
            self._stopping = True
        try:
            self._wake_writer.send(None)
        except OSError:
            pass

    def _watch(self) -> None:
        while True:
            by_sentinel = {c.sentinel: c for c in self.children}
            peers = [c for c in (self.peer_failure, self.peer_restart) if c is not None]
            fired = wait([*by_sentinel, self._wake_reader, *peers])
            with self._lock:
                if self._stopping:
                    return
            dead = next((by_sentinel[h] for h in fired if h in by_sentinel), None)
            if (
                dead is not None
                and dead.exit_code() == -signal.SIGTERM
                and self._stopped_within(TERM_GRACE_S)
            ):
                return  # the server's own shutdown: the group's SIGTERM reached the child first
            asked = None  # why another node's restart needs this node's
            if dead is None and self.peer_restart in fired and self.peer_failure not in fired:
                asked = str(self.peer_restart.recv())
            if (dead is None and asked is None) or self.restart is None:
                break
            message = dead.exit_message() if dead is not None else str(asked)
            try:
                children = self.restart(message, dead, self.children)
            except Exception:  # a bug in the hook must still take the server down, not leave it hanging
                logger.exception("the restart after %r raised", message)
                children = None
            if children is None:
                break
            self.children = children
        with self._lock:
            if self._stopping:
                return
            self._stopping = True  # a second death, or stop(), must not start another teardown
        if dead is not None:
            self._fail_child(dead)
        elif self.peer_failure is not None and self.peer_failure.poll():
            self._shut_down(str(self.peer_failure.recv()))
        else:  # the restart another node needed could not be made (the restart hook logged why)
            self._shut_down(str(asked))

    def _stopped_within(self, seconds: float) -> bool:
        """Whether stop() is called within `seconds`."""
        self._wake_reader.poll(seconds)
        with self._lock:
            return self._stopping

    def _cause(self, message: str) -> str | None:
        if self.explain is None:
            return None
        try:
            return self.explain(message)
        except Exception:
            logger.exception("explaining the failure raised")
            return None

    def _fail_child(self, dead: ChildProcess) -> None:
        message = dead.exit_message()
        cause = self._cause(message)
        self._shut_down(message if cause is None else f"{message}: {cause}", dead)

    def _shut_down(self, message: str, dead: ChildProcess | None = None) -> None:
        self.failure = message
        logger.critical("%s; shutting down the server", message)
        error = dead.read_error() if dead is not None else None
        if dead is not None and error is not None:
            logger.critical("%s failed with:\n%s", dead.label, error)
        if self.on_failure is not None:
            try:
                self.on_failure(message)
            except Exception:
                logger.exception("on_failure callback raised")
            time.sleep(self.grace_s)
        stop_children(self.children)
        self.done.set()
        self.exit_fn(self.exit_code)
