"""Spawned gloo ranks on loopback for a test: each process runs `target(rank, init_method)`, and
what it returns (or its traceback, as a string) comes back by rank."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

import torch

from model_executor.distributed.parallel_state import ParallelState, init_distributed
from srt.utils import free_port


def run_ranks(
    target: Callable[[int, str], Any], world_size: int = 2, timeout_s: float = 120
) -> dict[int, Any]:
    """`target` (a module-level function: it crosses the spawn) on `world_size` fresh processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_run, args=(target, rank, init, out)) for rank in range(world_size)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return results


def _run(target: Callable[[int, str], Any], rank: int, init_method: str, out: Any) -> None:
    try:
        out.put((rank, target(rank, init_method)))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def join(rank: int, init_method: str, tp_size: int = 1, pp_size: int = 1) -> ParallelState:
    """This spawned rank's process groups, on the CPU (gloo)."""
    return init_distributed(
        tp_size=tp_size,
        pp_size=pp_size,
        world_rank=rank,
        init_method=init_method,
        device=torch.device("cpu"),
        timeout_s=60,
    )
