"""The replicated weights registry (scheduler/weight_registry.py) on two gloo ranks: an update
failing on one rank leaves every rank on the old weights; and the weights the front end replays
after a restart (srt/frontend_recovery.py). On a scheduler and a server: tests/test_weight_updates.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from gloo_ranks import join, run_ranks

from model_executor.distributed.parallel_state import destroy_distributed
from scheduler.weight_registry import WeightRegistry
from srt.frontend_recovery import FrontendRecovery
from srt.io_struct import UpdateWeightsFromDiskReq
from srt.request_state import ControlCalls, version_spans


class FakeStage:
    """The runner's stage_weights: folders named "bad" refused; the commit records the folder."""

    def __init__(self) -> None:
        self.serving = "/a"

    def __call__(self, path: Path) -> Any:
        if "bad" in str(path):
            raise ValueError(f"{path}: not a readable safetensors file")
        return lambda: setattr(self, "serving", str(path))


def _update_rank(rank: int, init_method: str) -> tuple[Any, ...]:
    state = join(rank, init_method, tp_size=2)
    stage = FakeStage()
    registry = WeightRegistry(state.world, stage, lambda req: None, lambda reqs: None)
    queues: Any = type("Queues", (), {"waiting": [], "live": lambda self: []})()
    replies = []
    for msg in [
        UpdateWeightsFromDiskReq("r1", "/b", "v2"),
        UpdateWeightsFromDiskReq("r2", "/c" if rank == 0 else "/bad", "v3"),  # rank 1 alone fails
    ]:
        registry.receive(msg)
        replies += registry.between_steps(queues, in_flight=False)
    dist.barrier()
    destroy_distributed()
    return [(r.success, r.payload.get("message")) for r in replies], stage.serving, registry.version


def test_an_update_failing_on_one_rank_leaves_every_rank_on_the_old_weights() -> None:
    results = run_ranks(_update_rank)
    for rank in (0, 1):
        assert isinstance(results[rank], tuple), results[rank]  # else a traceback
        replies, serving, version = results[rank]
        assert replies[0][0] and not replies[1][0]
        assert replies[1][1].startswith("rank 1: /bad")
        assert serving == "/b" and version == "v2"


def test_a_restart_replays_the_weights_before_any_request() -> None:
    sent: list[Any] = []
    recovery = FrontendRecovery(4, {}, sent.append, lambda: None, ControlCalls())
    recovery.record_weights("/b", "v2")
    recovery.record_weights(None, "v3")  # a version renamed: the folder stays /b
    recovery.paused = True  # paused in place: the new engine holds its steps as well
    recovery.begin("test")
    recovery.resume()
    assert [type(m).__name__ for m in sent] == ["UpdateWeightsFromDiskReq", "PauseGenerationReq"]
    assert (sent[0].model_path, sent[0].weight_version) == ("/b", "v3")


def test_weight_versions_spans_say_which_version_produced_which_tokens() -> None:
    """SGLang's spans (a change is recorded only once a request has tokens): a change with no new
    token since the last leaves no span; a rename to the same version extends its span."""
    assert version_spans([], "default", 5) == [{"version": "default", "start": 0, "end": 5}]
    assert version_spans([("b", 3), ("a", 3), ("c", 7)], "c", 9) == [
        {"version": "b", "start": 0, "end": 3},
        {"version": "c", "start": 3, "end": 9},
    ]
