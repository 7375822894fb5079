"""torch.distributed start-up and the TP / PP / world groups of this process.

Rank layout (also in launcher/): world_rank = tp_size * pp_rank + tp_rank, so a TP group is a
contiguous run of world ranks and a PP group strides by tp_size.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model_executor.distributed.communicator import Communicator


@dataclass
class ParallelState:
    world: Communicator
    tp: Communicator
    pp: Communicator

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_in_group

    @property
    def pp_size(self) -> int:
        return self.pp.world_size


_STATE: ParallelState | None = None


def single_process_state() -> ParallelState:
    one = Communicator.single()
    return ParallelState(world=one, tp=one, pp=one)


def get_parallel_state() -> ParallelState:
    """The groups of this process; a single-rank state when torch.distributed was never set up."""
    return _STATE if _STATE is not None else single_process_state()


def init_distributed(
    *,
    tp_size: int,
    pp_size: int,
    world_rank: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 300.0,
    store_prefix: str = "",
) -> ParallelState:
    """Joins the world group and builds the TP and PP groups (each with a device and a gloo group).

    Every rank calls this with the same sizes; group creation is itself collective, so all ranks
    create every group in the same order. `store_prefix` goes before every key the groups write in
    the store at `init_method`: an engine restarted on the same store (srt/recovery.py) meets under a
    fresh prefix, away from the dead ranks' addresses and counters.
    """
    global _STATE
    world_size = tp_size * pp_size
    if not 0 <= world_rank < world_size:
        raise ValueError(f"world rank {world_rank} outside [0, {world_size}) for tp={tp_size} pp={pp_size}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1:
        _STATE = single_process_state()
        return _STATE
    store, _, _ = next(dist.rendezvous(init_method, world_rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(  # torch's own steps for an init_method, with the prefix added to its "default_pg"
        backend=backend,
        store=dist.PrefixStore(f"{store_prefix}default_pg", store),
        world_size=world_size,
        rank=world_rank,
        timeout=timeout,
    )

    def make(ranks: list[int]) -> Communicator:
        device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu_group = (
            device_group if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
        )
        return Communicator(
            ranks=ranks,
            rank_in_group=ranks.index(world_rank) if world_rank in ranks else -1,
            device_group=device_group,
            cpu_group=cpu_group,
        )

    world = make(list(range(world_size)))
    tp: Communicator | None = None
    pp: Communicator | None = None
    for pp_rank in range(pp_size):
        group = make([pp_rank * tp_size + t for t in range(tp_size)])
        if world_rank in group.ranks:
            tp = group
    for tp_rank in range(tp_size):
        group = make([p * tp_size + tp_rank for p in range(pp_size)])
        if world_rank in group.ranks:
            pp = group
    assert tp is not None and pp is not None
    _STATE = ParallelState(world=world, tp=tp, pp=pp)
    return _STATE


def destroy_distributed() -> None:
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()
