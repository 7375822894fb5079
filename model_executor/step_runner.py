"""StepRunner: a device's fast path for some batches, beside the model's op-by-op forward.

ModelRunner asks its one step runner for every batch: `can_run`, then `begin_step`, then `run`
where it said yes, the model's layers op by op where it said no. The CPU's is the fused decode
runner (model_executor/cpu/decode_runner.py); a CUDA-graph runner would be another, given by its
device's wing (model_executor/device_wing.py), with nothing in ModelRunner to change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_executor.distributed.pipeline import StageOutput
    from model_executor.forward_batch import ForwardBatch


class StepRunner(ABC):
    """Runs the batches it takes in fewer, larger calls than the model's layers (whole fused layers,
    a replayed graph), with the same results within the rounding of its own kernels."""

    # the GPU path it is in model_executor/gpu_status.GPU_VERIFIED (a CUDA graph runner's), if any
    gpu_path: str | None = None
    # whether `run` adds LoRA adapters' deltas as the layers' LoraLinearMethods do (else with LoRA
    # on every batch runs the layers op by op)
    takes_lora: bool = False

    @abstractmethod
    def prepare(self) -> None:
        """Once, after the weights are laid out and the KV pool and attention backend exist, before
        the first step: builds what `run` reuses (kernel arguments, captured graphs). Mutates only
        the runner."""

    @abstractmethod
    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `run` computes this batch. Mutates nothing and raises nothing; every rank of a
        tensor-parallel group answers the same for the same batch (the paths differ in collectives)."""

    @abstractmethod
    def begin_step(self, batch: ForwardBatch, runs: bool) -> None:
        """Called once per step before its forward, with `can_run`'s answer, whichever path then runs
        it: where the device sets per-step process state (the CPU wing: the thread count)."""

    @abstractmethod
    def run(self, batch: ForwardBatch) -> torch.Tensor | StageOutput:
        """This stage's part of a batch `can_run` took, as the model's forward returns it: the final
        hidden states [num_tokens, hidden] on the last pipeline stage, the hand-over on the others.
        Writes the step's K/V into the pool at `batch.out_cache_loc`, as the layers would. Raises
        AssertionError for a batch `can_run` declined."""


class NoStepRunner(StepRunner):
    """A device without a fast path: every batch runs the model's layers op by op."""

    def prepare(self) -> None:
        pass

    def can_run(self, batch: ForwardBatch) -> bool:
        return False

    def begin_step(self, batch: ForwardBatch, runs: bool) -> None:
        pass

    def run(self, batch: ForwardBatch) -> torch.Tensor | StageOutput:
        raise AssertionError("NoStepRunner takes no batch")
