"""The checker's own gloo groups, apart from every group the scheduler and the model use.

`dist.new_group` is collective over the whole world (every rank calls it for every group, member
or not, in the same order), so `create_groups` must run on every rank at the same point of
start-up: right after `init_distributed`, before anything else creates a group.

Layout (as in model_executor/distributed/parallel_state.py): world_rank = tp_size * pp_rank +
tp_rank; a TP group is a contiguous run of world ranks, a PP group strides by tp_size.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class CheckGroup:
    """One group this rank compares its events with; `group` is None when it is only this rank."""

    name: str  # "tp" or "pp"
    ranks: tuple[int, ...]  # world ranks
    group: Any

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ConsensusGroups:
    world_rank: int
    world_size: int
    world: Any  # carries only the checker's stop vote; None when world_size == 1
    tp: CheckGroup
    pp: CheckGroup
    gate: Any = None  # this rank's TP ranks again, for the main thread's per-step check (checker.py)

    @property
    def compared(self) -> list[CheckGroup]:
        """The groups a round compares, in the order every rank runs them (size-1 groups skipped)."""
        return [g for g in (self.tp, self.pp) if g.size > 1]


def tp_ranks(tp_size: int, pp_rank: int) -> tuple[int, ...]:
    return tuple(pp_rank * tp_size + t for t in range(tp_size))


def pp_ranks(tp_size: int, pp_size: int, tp_rank: int) -> tuple[int, ...]:
    return tuple(p * tp_size + tp_rank for p in range(pp_size))


def create_groups(tp_size: int, pp_size: int, world_rank: int, timeout_s: float = 300.0) -> ConsensusGroups:
    """Creates the checker's world, TP and PP gloo groups; returns the ones this rank is in.

    Call on every rank, after torch.distributed is initialised (not needed when world_size == 1).
    `timeout_s` bounds each of the checker's collectives: a peer that stopped answering makes
    the checker thread log the error and stop after that long, never hang forever.
    """
    world_size = tp_size * pp_size
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp_size ({tp_size}) and pp_size ({pp_size}) must be >= 1")
    if not 0 <= world_rank < world_size:
        raise ValueError(f"world_rank {world_rank} outside [0, {world_size}) for tp={tp_size} pp={pp_size}")
    tp_rank, pp_rank = world_rank % tp_size, world_rank // tp_size
    my_tp, my_pp = tp_ranks(tp_size, pp_rank), pp_ranks(tp_size, pp_size, tp_rank)
    if world_size == 1:
        return ConsensusGroups(
            world_rank, 1, None, CheckGroup("tp", my_tp, None), CheckGroup("pp", my_pp, None)
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "consensus.create_groups needs torch.distributed initialised (call init_distributed first)"
        )
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"tp_size * pp_size = {world_size} but torch.distributed has {dist.get_world_size()} ranks"
        )
    timeout = datetime.timedelta(seconds=timeout_s)

    def new_group(ranks: tuple[int, ...]) -> Any:
        return dist.new_group(list(ranks), backend="gloo", timeout=timeout)

    world = new_group(tuple(range(world_size)))
    tp_group = pp_group = None
    if tp_size > 1:
        for p in range(pp_size):
            group = new_group(tp_ranks(tp_size, p))
            tp_group = group if p == pp_rank else tp_group
    if pp_size > 1:
        for t in range(tp_size):
            group = new_group(pp_ranks(tp_size, pp_size, t))
            pp_group = group if t == tp_rank else pp_group
    gate = None
    if tp_size > 1:  # the main thread's own group: never interleaved with the checker thread's
        for p in range(pp_size):
            group = new_group(tp_ranks(tp_size, p))
            gate = group if p == pp_rank else gate
    return ConsensusGroups(
        world_rank,
        world_size,
        world,
        CheckGroup("tp", my_tp, tp_group),
        CheckGroup("pp", my_pp, pp_group),
        gate,
    )
