"""The background thread that compares this rank's event log with its TP and PP peers.

Every `interval_s` each rank's checker thread runs one cycle, all ranks in the same order:

    1. stop vote (world group): MIN all-reduce of [-stop]; if any rank asked to stop, every
       thread leaves here, at the same cycle, so no peer is left waiting in a collective.
    2. for each group in [tp, pp] (size-1 groups skipped), a round:
       a. agreed = MIN all-reduce of the local event count (compare only what all have logged)
       b. d = digest of the events [checked_upto, agreed); MIN all-reduce of [d, -d] gives MIN
          and MAX at once; equal -> checked_upto = agreed, and events every group has compared
          are dropped from memory.
       c. MIN != MAX -> all_gather the per-event digests of the window (equal lengths: the window
          is agreed), the first column where ranks differ is the first diverging event; every
          rank gathers every rank's events around it, logs CRITICAL "... divergence ..." and
          calls on_divergence(message) (default: flush logs, os._exit(70)). A callback that
          returns ends the thread; the checker does not resume.

Besides, the main thread calls `agree_before_step` with a digest of the batch it is about to run:
one MIN all-reduce of [d, -d] over its TP ranks, on a group of its own. TP ranks that scheduled
different batches would next issue model collectives of different sizes, which gloo may answer
by aborting a process (SIGABRT) before any cycle has compared the logs; the gate stops them first
and lets the thread name the divergence.

Every branch depends only on all-reduced values, so all members take it together. The cycle
order is the same on every rank (stop, tp, pp, stop, tp, pp ...), so the collectives form one
global order and cannot deadlock; they run on the checker's own gloo groups only, never on the
scheduler's, so the main thread is never blocked by them. A failed collective (a peer died,
the group timeout passed) is logged and ends the thread; the supervisor handles dead ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from consensus.canonical import window_digest
from consensus.event_log import Event, EventLog
from consensus.groups import CheckGroup, ConsensusGroups

logger = logging.getLogger("srt.consensus")

DIVERGENCE_EXIT_CODE = 70  # EX_SOFTWARE


def exit_on_divergence(message: str) -> None:
    """The default on_divergence: the server must not keep serving from ranks that disagree."""
    for handler in [*logging.getLogger().handlers, *logger.handlers]:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(DIVERGENCE_EXIT_CODE)


class ConsensusChecker:
    def __init__(
        self,
        groups: ConsensusGroups,
        log: EventLog,
        *,
        interval_s: float = 1.0,
        on_divergence: Callable[[str], None] = exit_on_divergence,
        context_events: int = 2,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.groups = groups
        self.interval_s = interval_s
        self.on_divergence = on_divergence
        self.context_events = context_events
        self.cycles = 0  # completed cycles of the background thread
        self.diverged = False
        self._log = log
        self._checked = {g.name: 0 for g in groups.compared}  # identical on all members of each group
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def checked_upto(self) -> dict[str, int]:
        """Per group: events [0, n) have been compared and agreed."""
        return dict(self._checked)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> ConsensusChecker:
        if self._thread is not None:
            raise RuntimeError("the consensus checker thread was already started")
        if self.groups.compared:
            self._thread = threading.Thread(target=self._run, name="srt-rank-consensus", daemon=True)
            self._thread.start()
        return self

    def settle(self, timeout_s: float) -> bool:
        """Waits (up to timeout_s) for two more background cycles, so everything logged so far is
        compared. A rank whose collective just failed calls this before exiting: when ranks
        diverged, the failure is usually the divergence's symptom, and the checker names the cause
        (on divergence the thread exits the process). Returns whether the cycles completed."""
        target = self.cycles + 2
        deadline = time.monotonic() + timeout_s
        while self.running and self.cycles < target and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.cycles >= target

    def check_now(self) -> bool:
        """One synchronous round on each compared group (collective: all ranks call it together).
        Returns False on divergence (after on_divergence). Only while the thread is not running."""
        if self.running:
            raise RuntimeError("check_now() would interleave collectives with the running checker thread")
        return all(self._round(g) for g in self.groups.compared)

    def agree_before_step(self, digest: int) -> None:
        """Collective over this rank's TP group (every TP rank, every step, before the forward).
        Returns when every TP rank passed the same digest; otherwise waits for the thread to name
        the divergence (it exits the process) and raises RuntimeError if it did not."""
        if self.groups.gate is None:
            return
        min_max = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(min_max, op=dist.ReduceOp.MIN, group=self.groups.gate)
        if int(min_max[0]) == -int(min_max[1]):
            return
        logger.error("TP ranks are about to run different batches; comparing their event logs")
        self.settle(timeout_s=5 * self.interval_s + 5.0)
        raise RuntimeError("TP ranks scheduled different batches (the rank consensus gate stopped the step)")

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Asks every rank's thread to stop at the next stop vote and waits for this rank's.

        Returns at the latest after `timeout_s` (default 2 * interval_s + 5 s): False, with a
        warning, when the thread is still alive (a peer's checker is gone or stuck); the thread is
        a daemon, so it never keeps the process alive.
        """
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s if timeout_s is not None else 2 * self.interval_s + 5.0)
        if self._thread.is_alive():
            logger.warning(
                "rank consensus checker thread did not stop within the timeout; leaving it (daemon)"
            )
            return False
        return True

    def _run(self) -> None:
        try:
            while True:
                self._stop.wait(self.interval_s)
                if self._vote_stop():
                    return
                for group in self.groups.compared:
                    if not self._round(group):
                        return
                self.cycles += 1
        except Exception:
            logger.exception(
                "rank consensus checker stopped after a failed collective (is a peer rank gone?)"
            )

    def _vote_stop(self) -> bool:
        vote = torch.tensor([-int(self._stop.is_set())], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.groups.world)
        return int(vote[0]) < 0

    def _round(self, group: CheckGroup) -> bool:
        start = self._checked[group.name]
        agreed_t = torch.tensor([self._log.count], dtype=torch.int64)
        dist.all_reduce(agreed_t, op=dist.ReduceOp.MIN, group=group.group)
        agreed = int(agreed_t[0])
        if agreed <= start:
            return True
        events = self._log.window(start, agreed)
        digest = window_digest(start, [e.digest for e in events])
        min_max = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(min_max, op=dist.ReduceOp.MIN, group=group.group)
        if int(min_max[0]) == -int(min_max[1]):
            self._checked[group.name] = agreed
            self._log.drop_before(min(self._checked.values()))
            return True
        self.diverged = True
        message = self._describe_divergence(group, start, events)
        logger.critical(message)
        self.on_divergence(message)
        return False

    def _describe_divergence(self, group: CheckGroup, start: int, events: list[Event]) -> str:
        mine = torch.tensor([e.digest for e in events], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(group.size)]
        dist.all_gather(gathered, mine, group=group.group)
        table = torch.stack(gathered)
        differs = (table != table[0]).any(dim=0).nonzero().flatten()
        first = int(differs[0]) if len(differs) else 0  # only a digest collision could leave it empty
        lo, hi = max(0, first - self.context_events), min(len(events), first + self.context_events + 1)
        local = [(e.seq, e.describe()) for e in events[lo:hi]]
        everyone: list[list[tuple[int, str]] | None] = [None] * group.size
        dist.all_gather_object(everyone, local, group=group.group)
        index = start + first
        lines = [
            f"rank consensus divergence in the {group.name.upper()} group (world ranks {list(group.ranks)}): "
            f"first diverging event #{index} (compared events [{start}, {start + len(events)}))"
        ]
        for rank, described in zip(group.ranks, everyone):
            me = " (this rank)" if rank == self.groups.world_rank else ""
            lines.append(f"  world rank {rank}{me}:")
            lines += [f"    {'>>' if seq == index else '  '} {text}" for seq, text in described or []]
        return "\n".join(lines)
