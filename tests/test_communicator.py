"""The collectives and the pipeline link on two real gloo ranks (spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from gloo_ranks import join, run_ranks

from model_executor.distributed.parallel_state import destroy_distributed
from model_executor.distributed.pipeline import StageLink, StageOutput

OBJECTS: list[Any] = [[], {"rid": "r1", "ids": [1, 2, 3]}, [], ["abort", None], []]


def _rank(rank: int, init_method: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    # tp=1, pp=2: the world and the PP group are ranks [0, 1]
    state = join(rank, init_method, pp_size=2)
    broadcasts = 0
    real = dist.broadcast

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal broadcasts
        broadcasts += 1
        return real(*args, **kwargs)

    dist.broadcast = counting  # type: ignore[assignment]
    got = [state.world.broadcast_pyobj(obj if rank == 0 else None) for obj in OBJECTS]
    dist.broadcast = real
    link = StageLink(state.pp)
    if rank == 0:  # the first stage: messages and hidden states on; ids come back
        for obj in OBJECTS:
            link.send_object(obj, link.next)
        link.send_stage_output(
            StageOutput(
                torch.full((3, 4), 1.5, dtype=torch.float32),
                torch.arange(12, dtype=torch.float32).view(3, 4) + 0.125,  # the float32 stream
            )
        )
        ids = link.recv_ids(3).tolist()
        result = {"got": got, "broadcasts": broadcasts, "ids": ids}
    else:  # the last stage
        objects = [link.recv_object(link.prev) for _ in OBJECTS]
        stage = link.recv_stage_output(3, 4, torch.device("cpu"))
        link.send_ids(torch.tensor([7, 8, 9]))
        result = {
            "got": got,
            "broadcasts": broadcasts,
            "objects": objects,
            "hidden": stage.hidden.float().tolist(),
            "residual": stage.residual.tolist(),
            "residual_dtype": str(stage.residual.dtype),
        }
    dist.barrier()
    destroy_distributed()
    return result


def test_broadcasts_and_stage_traffic_on_two_gloo_ranks() -> None:
    results = run_ranks(_rank)
    for rank in (0, 1):
        assert isinstance(results[rank], dict), results[rank]  # else a traceback
        assert results[rank]["got"] == OBJECTS
        # an empty list is its size alone; anything else is size + bytes
        assert results[rank]["broadcasts"] == 3 * 1 + 2 * 2
    assert results[1]["objects"] == OBJECTS
    assert results[1]["hidden"] == [[1.5] * 4] * 3
    assert results[1]["residual"] == [[4 * i + j + 0.125 for j in range(4)] for i in range(3)]
    assert results[1]["residual_dtype"] == "torch.float32"
    assert results[0]["ids"] == [7, 8, 9]
