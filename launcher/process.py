"""Spawning children and the start-up handshake.

Each child gets two pipes: `ready` (child -> parent: ("ready", info) or ("error", traceback))
and a `lifeline` the parent holds open and never writes, so the child sees EOF when the parent
dies. The parent waits on every ready pipe AND every process sentinel at once, so a child that
dies during start-up fails the launch immediately instead of after a timeout.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from launcher.child import ChildSpec, child_main
from launcher.teardown import kill_process_tree

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A child failed, died or hung during start-up; the message names it."""


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exited (exit status unknown)"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class ChildProcess:
    """The parent's handle on one spawned child."""

    def __init__(
        self, spec: ChildSpec, process: BaseProcess, ready_conn: Connection, lifeline: Connection
    ) -> None:
        self.spec = spec
        self.process = process
        self.ready_conn = ready_conn
        self._lifeline = lifeline  # held open for the child's lifetime: closing it is our death
        self.info: dict[str, Any] | None = None  # the child's ("ready", info) payload

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def label(self) -> str:
        return f"{self.name} (pid {self.pid})"

    def exit_code(self) -> int | None:
        """Its exit status once it has exited: the sentinel can fire a moment before the status is
        there, so this waits for it (up to 2 s)."""
        self.process.join(timeout=2.0)
        return self.process.exitcode

    def exit_message(self, when: str = "") -> str:
        """'scheduler TP1 (pid 1234) exited with code 1 during start-up'. Call once it has exited."""
        return f"{self.label} {describe_exit(self.exit_code())}{when}"

    def read_error(self) -> str | None:
        """The traceback the child sent before dying, if any; never blocks."""
        try:
            while self.ready_conn.poll():
                kind, payload = self.ready_conn.recv()
                if kind == "error":
                    return str(payload)
        except (EOFError, OSError):
            pass
        return None


def spawn_child(spec: ChildSpec) -> ChildProcess:
    """Start `spec` in a fresh interpreter (spawn context).

    The child's parent-death signal fires when the spawning *thread* exits, so spawn from the
    main thread (or a thread that lives as long as the server).
    """
    ctx = mp.get_context("spawn")
    ready_reader, ready_writer = ctx.Pipe(duplex=False)
    lifeline_reader, lifeline_writer = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=child_main, name=spec.name, args=(spec, ready_writer, lifeline_reader, os.getpid())
    )
    process.start()
    ready_writer.close()
    lifeline_reader.close()
    return ChildProcess(spec, process, ready_reader, lifeline_writer)


def wait_ready(
    children: list[ChildProcess], timeout: float, abort: Sequence[Connection] = ()
) -> dict[str, dict[str, Any]]:
    """Block until every child sent ("ready", info); return {child name: info}.

    Raises LaunchError at once when any child reports an error or exits (its traceback is
    logged), when a message arrives on one of `abort` (another node went down, or restarts: the
    message says which), or after `timeout` s naming the children still starting. The caller
    kills them.
    """
    deadline = time.monotonic() + timeout
    pending = list(children)
    by_handle: dict[Any, ChildProcess] = {}
    for child in children:
        by_handle[child.ready_conn] = child
        by_handle[child.sentinel] = child
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(c.label for c in pending)
            raise LaunchError(f"{names} not ready within {timeout:.0f} s")
        handles = [c.ready_conn for c in pending] + [c.sentinel for c in children]
        ready = wait(handles + list(abort), remaining)
        for conn in abort:
            if conn in ready:
                raise LaunchError(str(conn.recv()))
        fired = {id(by_handle[h]): by_handle[h] for h in ready}
        for child in fired.values():
            _check_child(child)
        pending = [c for c in pending if c.info is None]
    return {c.name: c.info for c in children if c.info is not None}


def _check_child(child: ChildProcess) -> None:
    """Consume what `child` sent; raise LaunchError if it failed or has exited."""
    if child.info is None and child.ready_conn.poll():
        try:
            kind, payload = child.ready_conn.recv()
        except (EOFError, OSError):
            # Closed without a word: normally because it died; the join gives its exit status time.
            child.process.join(timeout=2.0)
            if child.process.is_alive():
                raise LaunchError(f"{child.label} closed its start-up pipe without reporting ready") from None
            raise LaunchError(child.exit_message(" during start-up")) from None
        if kind == "ready":
            child.info = dict(payload or {})
            logger.debug("%s is ready", child.label)
        elif kind == "error":
            logger.error("%s failed during start-up:\n%s", child.label, payload)
            lines = str(payload).strip().splitlines()
            raise LaunchError(f"{child.label} failed during start-up: {lines[-1] if lines else ''}")
        else:
            raise LaunchError(f"{child.label} sent {kind!r} instead of 'ready' during start-up")
    if not child.process.is_alive():
        error = child.read_error()
        if error is not None:
            logger.error("%s failed during start-up:\n%s", child.label, error)
        raise LaunchError(child.exit_message(" during start-up"))


def stop_children(children: list[ChildProcess], timeout: float = 5.0) -> None:
    """SIGKILL every child and its descendants, then reap the children."""
    for child in children:
        if child.process.pid is not None:
            kill_process_tree(child.pid, include_self=True, timeout=timeout)
    for child in children:
        child.process.join(timeout=timeout)
