"""LoraRegistry: one rank's replica of the LoRA adapters requests may name (ARCHITECTURE.md, "State
that changes while the server runs: one replicated registry").

It starts as `--lora-paths` (ids 1, 2, ... in order) and changes only by the control messages of
rank 0's broadcast, applied in the same iteration on every rank:

- LoadLoraAdapterReq: every rank attaches its shard of the folder under the next id; a MIN over the
  world agrees on success before the name becomes usable. A failure on any rank drops the shard
  everywhere, the registry stays as it was on all ranks, and the reply names the first failing
  rank's cause.
- UnloadLoraAdapterReq: the name is refused to new requests at once; the adapter is dropped, and
  the reply sent, in the first iteration where no request running or queued uses it.

Ids are never reused (the next id is one above the highest ever given, the same on every rank as
every rank applies the same changes): a prefix cached under an unloaded adapter's namespace can
never match a later adapter's request. Each change records the registry (names, ids, folders) as a
consensus event, so ranks whose registries differ are named by the checker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from consensus import rank_consensus
from model_executor.distributed.communicator import Communicator
from srt.io_struct import ControlReply, LoadLoraAdapterReq, UnloadLoraAdapterReq
from srt.lora_config import LoraRef

logger = logging.getLogger("srt.scheduler")

# (adapter id, its shard or None to drop it): the runner's set_lora_adapter
AttachAdapter = Callable[[int, LoraRef | None], None]


def agree(world: Communicator, error: str | None) -> str | None:
    """None when every rank succeeded; else the cause on the first rank that failed (a MIN over the
    world of each rank's index, or the world's size for success). Every rank calls it in the same
    iteration (a change of a replicated registry: this one, scheduler/weight_registry.py)."""
    if world.world_size == 1:
        return error
    size = world.world_size
    first = world.cpu_all_reduce_int(size if error is None else world.rank_in_group)
    if first == size:
        return None
    cause = world.broadcast_pyobj(error, src_in_group=first)
    return str(cause) if first == 0 else f"rank {first}: {cause}"


@dataclass
class LoraRegistry:
    """The adapters by name (load order), their ids, the unloads waiting for their requests."""

    world: Communicator  # every rank of the server: a load is agreed over all of them
    attach: AttachAdapter
    adapters: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (id, folder)
    next_id: int = 1
    unloading: dict[str, str] = field(default_factory=dict)  # name -> the unload's request id

    @classmethod
    def of(cls, refs: tuple[LoraRef, ...], world: Communicator, attach: AttachAdapter) -> LoraRegistry:
        """The registry the runner loaded at start-up: `refs` as ids 1, 2, ..."""
        adapters = {ref.name: (i, ref.path) for i, ref in enumerate(refs, start=1)}
        return cls(world, attach, adapters, len(refs) + 1)

    def id_of(self, name: str) -> int | None:
        """The id a new request naming `name` runs under; None for no such adapter (or one being
        unloaded)."""
        if name in self.unloading or name not in self.adapters:
            return None
        return self.adapters[name][0]

    def apply(self, msg: LoadLoraAdapterReq | UnloadLoraAdapterReq) -> ControlReply | None:
        """A load's reply; an unload's now where it is refused, else from `finish_unloads`."""
        return self.load(msg) if isinstance(msg, LoadLoraAdapterReq) else self.begin_unload(msg)

    def load(self, msg: LoadLoraAdapterReq) -> ControlReply:
        """Every rank attaches its shard, then agrees; see the module's doc."""
        error: str | None = None
        adapter_id = self.next_id
        if msg.name in self.adapters:
            error = f"a LoRA adapter named {msg.name!r} is loaded already" + (
                " (its unload waits for its requests)" if msg.name in self.unloading else ""
            )
        else:
            try:
                self.attach(adapter_id, LoraRef(msg.name, msg.path))
            except (ValueError, OSError) as cause:
                error = str(cause)
            except Exception as cause:  # a corrupt file, say: agreed as a failure, never this rank's crash
                error = f"could not read LoRA adapter {msg.name!r} from {msg.path}: {type(cause).__name__}: {cause}"
        error = self._agree(error)
        if error is not None:
            self.attach(adapter_id, None)  # the ranks that attached it drop it
            logger.warning("LoRA adapter %r not loaded: %s", msg.name, error)
            return ControlReply(msg.request_id, False, {"message": error, **self._loaded()})
        self.adapters[msg.name] = (adapter_id, msg.path)
        self.next_id = adapter_id + 1
        self._changed()
        return ControlReply(msg.request_id, True, self._loaded())

    def begin_unload(self, msg: UnloadLoraAdapterReq) -> ControlReply | None:
        """Refuses the name to new requests; the reply now for no such adapter, else from
        `finish_unloads`."""
        if msg.name not in self.adapters or msg.name in self.unloading:
            message = f"no LoRA adapter named {msg.name!r} is loaded"
            return ControlReply(msg.request_id, False, {"message": message, **self._loaded()})
        self.unloading[msg.name] = msg.request_id
        return None

    def finish_unloads(self, in_use: Collection[int]) -> list[ControlReply]:
        """Drops every adapter being unloaded that no request (`in_use`: the ids of the requests
        running or queued) uses any more; the replies to their unloads."""
        replies = []
        for name, request_id in list(self.unloading.items()):
            adapter_id = self.adapters[name][0]
            if adapter_id in in_use:
                continue
            self.attach(adapter_id, None)
            del self.unloading[name], self.adapters[name]
            self._changed()
            replies.append(ControlReply(request_id, True, self._loaded()))
        return replies

    def _agree(self, error: str | None) -> str | None:
        return agree(self.world, error)

    def _loaded(self) -> dict[str, dict[str, str]]:
        """SGLang's loaded_adapters: name -> folder, the ones new requests may name."""
        return {
            "loaded_adapters": {n: path for n, (_, path) in self.adapters.items() if n not in self.unloading}
        }

    @rank_consensus(result=True, name="lora_registry")
    def _changed(self) -> list[tuple[str, int, str]]:
        """The registry after a change, as a consensus event: (name, id, folder) in load order."""
        snapshot = self.snapshot()
        logger.info("LoRA adapters now: %s", ", ".join(f"{n} (id {i})" for n, i, _ in snapshot) or "none")
        return snapshot

    def snapshot(self) -> list[tuple[str, int, str]]:
        return [(name, adapter_id, path) for name, (adapter_id, path) in self.adapters.items()]
