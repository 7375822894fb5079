"""Rank consensus: catch ranks that quietly disagree, since in Model B nobody broadcasts a plan.

Start-up, on every rank, in this order (create_groups is collective over the whole world):

    parallel = init_distributed(tp_size=..., pp_size=..., world_rank=..., ...)
    if server_args.enable_rank_consensus_checker:
        consensus.enable(consensus.create_groups(tp_size, pp_size, world_rank))
    ... build the scheduler, run the event loop ...
    consensus.disable()   # on orderly shutdown; coordinated, bounded by a timeout

Record with `@rank_consensus` (decorator.py) or `consensus.record(name, payload)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from consensus import event_log as _event_log
from consensus.canonical import canonical, event_digest
from consensus.checker import DIVERGENCE_EXIT_CODE, ConsensusChecker, exit_on_divergence
from consensus.decorator import rank_consensus
from consensus.event_log import LOG, Event, EventLog, record, set_enabled
from consensus.groups import CheckGroup, ConsensusGroups, create_groups

__all__ = [
    "DIVERGENCE_EXIT_CODE",
    "LOG",
    "agree_before_step",
    "CheckGroup",
    "ConsensusChecker",
    "ConsensusGroups",
    "Event",
    "EventLog",
    "create_groups",
    "disable",
    "enable",
    "exit_on_divergence",
    "get_checker",
    "is_enabled",
    "rank_consensus",
    "record",
]

logger = logging.getLogger("srt.consensus")

_CHECKER: ConsensusChecker | None = None


def enable(
    groups: ConsensusGroups,
    *,
    interval_s: float = 1.0,
    on_divergence: Callable[[str], None] = exit_on_divergence,
    start: bool = True,
) -> ConsensusChecker:
    """Starts recording (from an empty log) and, if `start`, the background checker thread.

    Call on every rank at the same point of start-up, before the first recorded event: a rank
    that starts recording later than its peers diverges at once. With a single rank there is
    nothing to compare, so recording stays off and no thread starts.
    """
    global _CHECKER
    if _CHECKER is not None:
        raise RuntimeError("the rank consensus checker is already enabled; call consensus.disable() first")
    LOG.clear()
    _CHECKER = ConsensusChecker(groups, LOG, interval_s=interval_s, on_divergence=on_divergence)
    if not groups.compared:
        logger.info("rank consensus checker: a single rank has nothing to compare; staying off")
        return _CHECKER
    set_enabled(True)
    if start:
        _CHECKER.start()
    logger.info(
        "rank consensus checker on: comparing with %s every %.2f s",
        ", ".join(f"{g.name.upper()} ranks {list(g.ranks)}" for g in groups.compared),
        interval_s,
    )
    return _CHECKER


def agree_before_step(payload: object) -> None:
    """While the checker is on: a collective over the TP group comparing `payload` (the batch
    about to run) on every TP rank; see ConsensusChecker.agree_before_step. Off: nothing."""
    if _CHECKER is not None and _event_log.ENABLED:
        _CHECKER.agree_before_step(event_digest("step", canonical(payload)))


def disable(timeout_s: float | None = None) -> bool:
    """Stops recording and the thread (see ConsensusChecker.shutdown); True if the thread ended."""
    global _CHECKER
    set_enabled(False)
    checker, _CHECKER = _CHECKER, None
    stopped = checker.shutdown(timeout_s) if checker is not None else True
    LOG.clear()
    return stopped


def is_enabled() -> bool:
    return _event_log.ENABLED


def get_checker() -> ConsensusChecker | None:
    return _CHECKER
