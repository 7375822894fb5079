"""Process-tree teardown and the Linux process-control calls that make it reliable."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

import psutil

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        logger.warning("prctl(%d, %d) failed: %s", option, arg, os.strerror(ctypes.get_errno()))
        return False
    return True


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """The kernel sends `sig` to this process when the thread that forked it exits (Linux only)."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init, so a final
    `kill_process_tree(os.getpid())` still finds the children of a child that already died."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, waiting for its parent to reap it
    except psutil.NoSuchProcess:
        return True


def kill_process_tree(
    pid: int, include_self: bool = True, sig: int = signal.SIGKILL, timeout: float = 5.0
) -> list[int]:
    """Send `sig` to every descendant of `pid` (and to `pid` itself when include_self) and wait
    up to `timeout` s until they are dead. Returns the pids still alive after that.

    Dead direct children are left as zombies rather than reaped here, so a multiprocessing
    `Process` can still read its exit code. With include_self and pid == os.getpid(), this
    process signals itself last.
    """
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    if include_self:
        procs.append(root)
    me = os.getpid()
    for proc in procs:
        if proc.pid == me:
            continue
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    if include_self and pid == me:
        os.kill(me, sig)
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if p.pid != me]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not _gone(p)]
        if alive:
            time.sleep(0.02)
    return [p.pid for p in alive]
