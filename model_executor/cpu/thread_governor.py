"""A rank's torch threads, from the load that other processes put on its CPUs.

On a shared machine a rank with one thread per core loses most of its speed once another job takes
a core: every OpenMP region of a step ends in a barrier that waits for the thread whose core the
other job holds, and a step has hundreds of regions. One thread fewer, on the cores left free, is
faster then (docs/performance.md, "co-located load"). About once a second the governor measures
how many of the rank's CPUs other processes keep busy, the CPUs' busy time in /proc/stat less the
CPU time of this server's own processes, and runs the rank on the rest, at least one thread; when
the other load goes, the threads come back. A change needs two windows in a row that agree.

The governed count applies only to the steps whose bits do not depend on it, those that run
wholly in our kernels (CpuDecodeRunner: the decode batches `can_run` takes, and prefills short
enough for the packed linears, `prefill_in_kernels`): the kernels share out whole outputs, and decode attention splits a request as if
it had the configured threads (kernels.ops.set_split_threads). Every other step (a long prefill on
oneDNN's GEMM, torch's ops) runs on the configured threads, so a request's tokens are the same
under any load (tests/test_thread_governor.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import psutil
import torch

from model_executor.cpu.kernels import ops

logger = logging.getLogger(__name__)

WINDOW_S = 1.0  # seconds of CPU accounting per decision (/proc/stat counts in 10 ms ticks)
STALE_S = 4 * WINDOW_S  # a longer window (the rank was idle) only starts the next one
TREE_REFRESH_S = 10.0  # how often the list of the server's own processes is read again
PROC_STAT = "/proc/stat"


def cpus_busy_s(cpus: frozenset[int], count_nice: bool, path: str = PROC_STAT) -> float:
    """Seconds the CPUs in `cpus` spent busy since boot: everything but idle and iowait (a
    hypervisor's steal counts: the time is gone for us too), and the time of niced processes only
    with `count_nice` (a rank that is not niced itself takes the CPU from them whenever it runs)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open(path) as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
                busy += user + (nice if count_nice else 0) + system + irq + softirq + steal
    return busy / tick


def server_processes() -> list[psutil.Process]:
    """This process, its ancestors up to the `launch_server` process, and all of that one's
    descendants: the server's own CPU users (front end, detokenizer, every local rank). Outside a
    server (the offline Engine in a user's process) this process and its descendants."""
    me = psutil.Process()
    root = me
    try:
        for parent in me.parents():
            if any("launch_server" in part for part in parent.cmdline()):
                root = parent
                break
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [me]


class ServerCpuTime:
    """Seconds of CPU the server's own processes used, summed over the living ones and the ones
    seen before that are gone (their last reading)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.procs: dict[int, psutil.Process] = {}
        self.last: dict[int, float] = {}
        self.refreshed = -TREE_REFRESH_S

    def __call__(self) -> float:
        now = self.clock()
        if now - self.refreshed >= TREE_REFRESH_S:
            self.refreshed = now
            for p in server_processes():
                self.procs.setdefault(p.pid, p)
        for pid, p in list(self.procs.items()):
            try:
                t = p.cpu_times()
                self.last[pid] = t.user + t.system
            except psutil.Error:
                del self.procs[pid]  # its last reading stays in self.last
        return sum(self.last.values())


class ThreadGovernor:
    """`apply(governed)` before each step: `poll` (at most once a WINDOW_S it reads the CPUs' busy
    time and the server's own CPU time, and moves `current` to `threads` less the cores others kept
    busy, rounded, at least 1), then runs the step on `current` threads where `governed`, else on
    `threads`, the configured count."""

    def __init__(
        self,
        threads: int,
        busy_s: Callable[[], float],
        own_s: Callable[[], float],
        *,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.current = threads  # what governed steps run on
        self.applied = threads  # what the last step ran on
        self.busy_s, self.own_s, self.clock, self.set_threads = busy_s, own_s, clock, set_threads
        self.others = 0.0  # cores the others kept busy in the last window
        self.proposed = threads  # the last window's count, not yet agreed by a second
        self.t0, self.busy0, self.own0 = clock(), busy_s(), own_s()

    @classmethod
    def for_this_rank(cls) -> ThreadGovernor | None:
        """The governor of this process's torch threads over the CPUs it may run on; None where
        there is nothing to govern (one thread) or no /proc/stat to read."""
        threads = torch.get_num_threads()
        if threads < 2 or not os.path.exists(PROC_STAT):
            return None
        cpus = frozenset(os.sched_getaffinity(0))
        niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
        ops.set_split_threads(threads)
        return cls(threads, lambda: cpus_busy_s(cpus, niced), ServerCpuTime())

    def apply(self, governed: bool) -> None:
        self.poll()
        want = self.current if governed else self.threads
        if want != self.applied:
            self.set_threads(want)
            self.applied = want

    def restore(self) -> None:
        """Back to the configured threads (the offline Engine, between calls, in a user's process)."""
        if self.applied != self.threads:
            self.set_threads(self.threads)
            self.applied = self.threads

    def poll(self) -> None:
        now = self.clock()
        elapsed = now - self.t0
        if elapsed < WINDOW_S:
            return
        busy, own = self.busy_s(), self.own_s()
        if elapsed > STALE_S:  # the rank sat idle: that window says little about the load now
            self.t0, self.busy0, self.own0 = now, busy, own
            return
        self.others = max(0.0, (busy - self.busy0) - (own - self.own0)) / elapsed
        self.t0, self.busy0, self.own0 = now, busy, own
        want = max(1, self.threads - int(self.others + 0.5))
        if want != self.current and want == self.proposed:
            logger.info(
                "other processes kept %.1f of this rank's CPUs busy: %d torch threads (configured %d) for the steps in our kernels",
                self.others,
                want,
                self.threads,
            )
            self.current = want
        self.proposed = want
