"""WeightRegistry: one rank's replica of the weights' identity (folder, version) and of the pause
state, the RL rollout protocol's half on the ranks (ARCHITECTURE.md, "State that changes while the
server runs: one replicated registry").

Every message here is a control message of rank 0's broadcast. They take effect in order, between
steps, in the first iteration where no launched batch is in flight (at once on one stage; a pipeline
first drains its micro-batches), the same iteration on every rank; until then no new batch starts.

- UpdateWeightsFromDiskReq: every rank loads its shard of the folder into a new model beside the
  serving one; a MIN over the world agrees (scheduler/lora_registry.py's `agree`); only then does
  every rank swap it in. A failure on any rank (no such folder, another config, a corrupt or short
  file, a missing or extra tensor) drops the new model everywhere, and the reply names the first
  failing rank's cause.
- A success moves the weights' epoch on: a new request's prefix-cache namespace holds it
  (mem_cache/radix_cache.py's Namespace), so no KV computed by the old weights serves it, and a
  waiting request (a retracted one included) is moved to the new epoch, its prompt recomputed. A
  running request keeps the KV it holds (SGLang's in-place resume) and goes on with the new weights.
- PauseGenerationReq stops new steps (`has_work` is then false: the rank waits idle and the
  watchdog sees no stalled work); `retract` also puts every running request back in the waiting
  queue with its tokens. ContinueGenerationReq runs steps again (harmless without a pause).
- UpdateWeightVersionReq renames the version the replies report.

Before a change of weights or version, every request's tokens not yet sent go out (`send_now`), so
the front end, which gets the reply after them, knows which version produced which tokens (SGLang's
`weight_versions` spans: srt/weight_updates.py).

Each change records (folder, version, epoch) as a consensus event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from consensus import rank_consensus
from model_executor.distributed.communicator import Communicator
from scheduler.admission import RequestQueues
from scheduler.lora_registry import agree
from scheduler.req import Req
from srt.io_struct import (
    ContinueGenerationReq,
    ControlReply,
    PauseGenerationReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightVersionReq,
)

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

logger = logging.getLogger("srt.scheduler")

WEIGHT_MESSAGES = (
    UpdateWeightsFromDiskReq,
    UpdateWeightVersionReq,
    PauseGenerationReq,
    ContinueGenerationReq,
)

# the runner's stage_weights: loads a folder beside the serving model, returns the swap
StageWeights = Callable[[Path], Callable[[], None]]


@dataclass
class WeightRegistry:
    world: Communicator  # every rank of the server: an update is agreed over all of them
    stage: StageWeights
    retract: Callable[[Req], None]  # the admission's retraction (kept tokens, KV released)
    send_now: Callable[[list[Req]], None]  # the output message of these requests' unsent tokens
    model_path: str = "--model-path"  # the folder of the last update from disk
    version: str = "default"  # SGLang's weight_version
    epoch: int = 0  # successful updates so far: the prefix cache's namespace field
    paused: bool = False
    pending: list[Any] = field(default_factory=list)  # WEIGHT_MESSAGES not yet applied

    @classmethod
    def of(cls, sched: Scheduler) -> WeightRegistry:
        """The registry of a scheduler (its world, runner, admission and outputs)."""

        def send_now(reqs: list[Req]) -> None:
            sched.outbox.extend(reqs)
            sched.flush_outputs()

        return cls(sched.parallel.world, sched.runner.stage_weights, sched.admission.retract, send_now)

    @property
    def holds_steps(self) -> bool:
        """No new batch starts: paused, or a message waits for the launched batches to drain."""
        return self.paused or bool(self.pending)

    def receive(self, msg: Any) -> None:
        self.pending.append(msg)

    def between_steps(self, queues: RequestQueues, in_flight: bool) -> list[ControlReply]:
        """Applies the pending messages once nothing is in flight; their replies."""
        if in_flight or not self.pending:
            return []
        messages, self.pending = self.pending, []
        return [self._apply(msg, queues) for msg in messages]

    def _apply(self, msg: Any, queues: RequestQueues) -> ControlReply:
        if isinstance(msg, (UpdateWeightsFromDiskReq, UpdateWeightVersionReq)):
            held = [r for r in queues.waiting + queues.live() if len(r.output_ids) > r.sent_len]
            if held:
                self.send_now(held)  # before the reply: the front end splits the tokens by version
        if isinstance(msg, UpdateWeightsFromDiskReq):
            return self._update(msg, queues)
        if isinstance(msg, UpdateWeightVersionReq):
            self.version = msg.new_version
            self._changed()
            return ControlReply(msg.request_id, True, self.identity())
        if isinstance(msg, PauseGenerationReq):
            self.paused = True
            if msg.mode == "retract":
                for req in reversed(list(queues.running)):  # newest first: the oldest ends up first
                    queues.running.remove(req)
                    self.retract(req)
            logger.info("generation paused (%s): %d requests held", msg.mode, self._held(queues))
            return ControlReply(msg.request_id, True, {"num_paused_requests": self._held(queues)})
        assert isinstance(msg, ContinueGenerationReq)
        was, self.paused = self.paused, False
        if was:
            logger.info("generation continues")
        return ControlReply(msg.request_id, True, {})

    def _update(self, msg: UpdateWeightsFromDiskReq, queues: RequestQueues) -> ControlReply:
        """Every rank stages, then agrees, then swaps; see the module's doc."""
        error: str | None = None
        commit: Callable[[], None] | None = None
        try:
            commit = self.stage(Path(msg.model_path))
        except (ValueError, OSError) as cause:
            error = str(cause)
        except Exception as cause:  # a corrupt file, a shape that does not fit: agreed, never a crash
            error = f"could not load weights from {msg.model_path}: {type(cause).__name__}: {cause}"
        error = agree(self.world, error)
        held = self._held(queues) if self.paused else 0
        if error is not None:
            logger.warning("weights not updated from %s: %s", msg.model_path, error)
            return ControlReply(msg.request_id, False, {"message": error, "num_paused_requests": held})
        assert commit is not None
        commit()
        self.model_path, self.epoch = msg.model_path, self.epoch + 1
        self.version = msg.weight_version if msg.weight_version is not None else self.version
        for req in queues.waiting:  # no KV yet: its prompt is computed by the new weights
            if req.req_pool_idx is None:
                req.weight_epoch = self.epoch
        self._changed()
        message = f"Succeeded to update model weights from {msg.model_path}."
        return ControlReply(
            msg.request_id, True, {"message": message, "num_paused_requests": held, **self.identity()}
        )

    @staticmethod
    def _held(queues: RequestQueues) -> int:
        return len(queues.waiting) + len(queues.live())

    def identity(self) -> dict[str, str]:
        return {"model_path": self.model_path, "weight_version": self.version}

    @rank_consensus(result=True, name="weight_registry")
    def _changed(self) -> tuple[str, str, int]:
        """The weights' identity after a change, as a consensus event."""
        logger.info("weights now: %s, version %s (epoch %d)", self.model_path, self.version, self.epoch)
        return (self.model_path, self.version, self.epoch)
