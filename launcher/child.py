"""What runs first inside every spawned child: title, parent-death wiring, threads, then the target.

Keep this module free of heavy imports (torch, the model): a spawned child imports it before the
thread count is set, and the target itself is imported only after that.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import setproctitle

from launcher.log import configure_logging
from launcher.teardown import kill_process_tree, set_parent_death_signal

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class ChildSpec:
    """One child process: `target` ("module:function") is called as target(*args, ready_conn).

    The target sends ("ready", info_dict) on ready_conn once it can serve. If it raises, the
    child sends ("error", traceback_text) and exits 1; the parent logs the traceback.
    """

    name: str  # in messages: "scheduler TP1"
    title: str  # process title: "srt::scheduler_TP1"
    target: str
    args: tuple[Any, ...] = ()
    num_threads: int | None = None  # torch intra-op threads; None leaves torch alone (and unimported)
    cpus: frozenset[int] | None = (
        None  # pinned to these CPUs first (SGLANG_CPU_OMP_THREADS_BIND); None: not pinned
    )
    log_level: str = "info"
    parent_death_signal: bool = True  # False leaves only the watcher thread (tests use it)


def resolve_target(target: str) -> Callable[..., Any]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"child target must be 'module:function', got {target!r}")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"child target {target!r} is not callable")
    return fn


def _die_with_parent(lifeline: Connection, parent_pid: int) -> None:
    """Fallback for the parent-death signal: the lifeline reaches EOF when the parent's process
    ends (its write end is never written), and our parent pid changes when we are re-parented."""
    while True:
        try:
            if lifeline.poll(PARENT_POLL_S):
                break
        except (EOFError, OSError):
            break
        if os.getppid() != parent_pid:
            break
    logger.critical("parent process %d is gone; exiting", parent_pid)
    kill_process_tree(os.getpid(), include_self=True)


def set_up_threads(name: str, threads: int, cpus: frozenset[int] | None) -> None:
    """A rank's first step: pinned to `cpus` (SGLANG_CPU_OMP_THREADS_BIND; None: not pinned), then
    `threads` torch intra-op threads (OpenMP and MKL told too, for what starts them later); logs
    the count. Imports torch."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)
    pinned = f", pinned to CPUs {sorted(cpus)}" if cpus is not None else ""
    logger.info("%s: %d torch threads%s", name, torch.get_num_threads(), pinned)


def child_main(spec: ChildSpec, ready_conn: Connection, lifeline: Connection, parent_pid: int) -> None:
    setproctitle.setproctitle(spec.title)
    # Ctrl-C reaches the whole foreground group; the parent decides how its children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.parent_death_signal:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(
        target=_die_with_parent, args=(lifeline, parent_pid), name="srt-parent-watch", daemon=True
    ).start()
    configure_logging(spec.log_level, spec.title.removeprefix("srt::"))
    try:
        if spec.num_threads is not None:
            set_up_threads(spec.name, spec.num_threads, spec.cpus)
        elif spec.cpus is not None:
            os.sched_setaffinity(0, spec.cpus)
        resolve_target(spec.target)(*spec.args, ready_conn)
    except Exception:
        text = traceback.format_exc()
        try:
            ready_conn.send(("error", text))
        except OSError:
            logger.critical("%s failed:\n%s", spec.name, text)
        sys.exit(1)
