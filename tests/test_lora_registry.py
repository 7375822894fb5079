"""The replicated LoRA registry (scheduler/lora_registry.py) on its own and on two gloo ranks: loads
agreed over the world, a failure anywhere leaving every rank's registry unchanged, unloads that wait
for their requests; and the changes the front end keeps for a restart's replay
(srt/frontend_recovery.py). The server's side: tests/test_lora_runtime.py."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from gloo_ranks import join, run_ranks

from consensus import LOG, set_enabled
from model_executor.distributed.communicator import Communicator
from model_executor.distributed.parallel_state import destroy_distributed
from scheduler.lora_registry import LoraRegistry
from srt.frontend_recovery import FrontendRecovery
from srt.io_struct import LoadLoraAdapterReq, UnloadLoraAdapterReq
from srt.lora_config import LoraRef
from srt.request_state import ControlCalls


class FakeLayers:
    """The runner's set_lora_adapter: what is attached, and folders named "bad" refused."""

    def __init__(self) -> None:
        self.attached: dict[int, str] = {}

    def __call__(self, adapter_id: int, ref: LoraRef | None) -> None:
        if ref is None:
            self.attached.pop(adapter_id, None)
        elif "bad" in ref.path:
            raise ValueError(f"LoRA adapter {ref.name!r}: target module x is no linear layer srt adapts")
        elif "corrupt" in ref.path:  # what a reader raises on a file cut short, say: no ValueError
            raise RuntimeError("invalid header length")
        else:
            self.attached[adapter_id] = ref.name


def test_the_registry_loads_refuses_and_unloads_once_no_request_uses_an_adapter() -> None:
    layers = FakeLayers()
    registry = LoraRegistry.of((LoraRef("a", "/a"),), Communicator.single(), layers)
    layers.attached[1] = "a"
    reply = registry.load(LoadLoraAdapterReq("r1", "b", "/b"))
    assert (
        reply.success
        and registry.id_of("b") == 2
        and reply.payload["loaded_adapters"] == {"a": "/a", "b": "/b"}
    )
    refused = registry.load(LoadLoraAdapterReq("r2", "c", "/bad"))
    assert not refused.success and "target module x" in refused.payload["message"]
    assert registry.snapshot() == [("a", 1, "/a"), ("b", 2, "/b")] and layers.attached == {1: "a", 2: "b"}
    assert not registry.load(LoadLoraAdapterReq("r3", "b", "/b2")).success  # a name loaded already
    broken = registry.load(LoadLoraAdapterReq("r5", "c", "/corrupt"))  # any exception is a refusal
    assert not broken.success and "RuntimeError: invalid header length" in broken.payload["message"]
    assert registry.snapshot() == [("a", 1, "/a"), ("b", 2, "/b")] and layers.attached == {1: "a", 2: "b"}
    assert registry.begin_unload(UnloadLoraAdapterReq("u1", "b")) is None
    assert registry.id_of("b") is None  # refused to new requests at once
    assert registry.finish_unloads({2}) == []  # a request still runs under it
    (done,) = registry.finish_unloads({0, 1})
    assert done.request_id == "u1" and done.success and layers.attached == {1: "a"}
    assert not registry.begin_unload(UnloadLoraAdapterReq("u2", "b")).success  # type: ignore[union-attr]
    assert registry.load(LoadLoraAdapterReq("r4", "b", "/b")).success
    assert registry.id_of("b") == 3  # ids are never reused: no cached prefix of the old "b" matches


def test_each_change_records_the_registry_for_the_consensus_checker() -> None:
    """Ranks whose registries differ are named by the checker: each load and finished unload
    records (name, id, folder) of every adapter; a refused load records nothing."""
    LOG.clear()
    set_enabled(True)
    try:
        registry = LoraRegistry.of((LoraRef("a", "/a"),), Communicator.single(), FakeLayers())
        registry.load(LoadLoraAdapterReq("r1", "b", "/b"))
        registry.load(LoadLoraAdapterReq("r2", "c", "/bad"))
        registry.begin_unload(UnloadLoraAdapterReq("u1", "a"))
        registry.finish_unloads(set())
        events = LOG.window(0, LOG.count)
    finally:
        set_enabled(False)
        LOG.clear()
    assert [(e.name, e.text) for e in events] == [
        ("lora_registry", "{'return':[('a',1,'/a',),('b',2,'/b',)]}"),
        ("lora_registry", "{'return':[('b',2,'/b',)]}"),
    ]


def _registry_rank(rank: int, init_method: str) -> tuple[Any, ...]:
    state = join(rank, init_method, tp_size=2)
    layers = FakeLayers()
    registry = LoraRegistry.of((), state.world, layers)
    # rank 1 alone cannot read the second folder: no rank keeps it
    good = registry.load(LoadLoraAdapterReq("r1", "a", "/a"))
    bad = registry.load(LoadLoraAdapterReq("r2", "b", "/b" if rank == 0 else "/bad"))
    dist.barrier()
    destroy_distributed()
    return good.success, bad.success, bad.payload["message"], registry.snapshot(), layers.attached


def test_a_load_failing_on_one_rank_leaves_every_ranks_registry_unchanged() -> None:
    results = run_ranks(_registry_rank)
    for rank in (0, 1):
        assert isinstance(results[rank], tuple), results[rank]  # else a traceback
        good, bad, message, snapshot, attached = results[rank]
        assert good and not bad
        assert message.startswith("rank 1: ") and "target module x" in message
        assert snapshot == [("a", 1, "/a")] and attached == {1: "a"}


def test_a_restart_replays_the_registry_changes_in_order() -> None:
    """FrontendRecovery keeps the changes since start-up (a runtime load unloaded again leaves
    none) and sends them before any replayed request."""
    sent: list[Any] = []
    recovery = FrontendRecovery(4, {}, sent.append, lambda: None, ControlCalls())
    recovery.record_lora("x", "/x")
    recovery.record_lora("start", None)  # an adapter of --lora-paths unloaded
    recovery.record_lora("y", "/y")
    recovery.record_lora("x", None)
    recovery.record_lora("start", "/start2")
    assert recovery.lora_changes == [("start", None), ("y", "/y"), ("start", "/start2")]
    recovery.begin("test")
    recovery.resume()
    assert [(type(m).__name__, m.name) for m in sent] == [
        ("UnloadLoraAdapterReq", "start"),
        ("LoadLoraAdapterReq", "y"),
        ("LoadLoraAdapterReq", "start"),
    ]
