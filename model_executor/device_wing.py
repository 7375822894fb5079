"""DeviceWing: what one device type adds to the device-neutral ModelRunner, picked by device type.

Made before the model is built, a wing chooses the fused ops that every layer built after it
calls (`fused_ops`: norms, activations, rotary, ...; layers/fused_ops.py). ModelRunner calls its
wing at four points of start-up: `check` before it builds the model, `prepare_weights` once the
weights are loaded (before memory is sized, so what it allocates counts as weights),
`pads_decode_batches` as it sizes the KV memory, `step_runner` once the KV pool and attention
backend exist. The CPU's wing is model_executor/cpu/wing.py; a device type without one gets this
base: torch ops for every linear and every fused op, every batch op by op. A new device's wing is a
subclass in its own folder and a line in DEVICE_WINGS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from model_executor.layers.fused_ops import TORCH_OPS, FusedOps, use_fused_ops
from model_executor.step_runner import NoStepRunner, StepRunner

if TYPE_CHECKING:
    from mem_cache.kv_memory import KVMemory
    from model_executor.attention.base import AttentionBackend
    from model_executor.distributed.parallel_state import ParallelState
    from model_executor.loader.load_weights import LoadHooks
    from model_executor.model_runner import RunnerConfig
    from model_executor.models.base import CausalLM


class DeviceWing:
    def __init__(self, config: RunnerConfig, parallel: ParallelState) -> None:
        """May set up the process for the device (the CPU wing: glibc keeps freed memory); chooses
        the process's fused ops (`fused_ops`)."""
        self.config = config
        self.parallel = parallel
        use_fused_ops(self.fused_ops())

    def fused_ops(self) -> FusedOps:
        """The fused ops for this device's layers, the kernels it has where they take the input.
        Called once, as the wing is made. Default: torch's."""
        return TORCH_OPS

    def check(self) -> None:
        """Raises ValueError naming what the configuration asks and this device lacks. Mutates
        nothing."""
        if self.config.quantization is not None:
            raise ValueError(
                f"--quantization {self.config.quantization} runs on --device cpu only; "
                f"got --device {self.config.device}"
            )

    def batch_invariant(self) -> bool:
        """Whether, with the --quantization asked for, a row's results are the same bits whatever else
        its batch holds: speculation (a verify step's rows against plain decode's) needs it. Mutates
        nothing. Default: yes (this base runs no quantization)."""
        return True

    def load_hooks(self, model: CausalLM) -> LoadHooks | None:
        """Before the checkpoint loads: what load_weights tells as each parameter's shards are read
        (to lay a weight out for the kernels once it is in and free its dense form before the next is
        read; to read a weight in the form the kernels take), or None. Default: None."""
        return None

    def prepare_weights(self, model: CausalLM, load_float32: Callable[[], CausalLM]) -> None:
        """Once, after the weights are loaded: lays them out for the device's kernels (each linear
        layer's linear method) and logs what it did. `load_float32` loads the checkpoint again in
        float32, for a layout that needs its exact values. Mutates the model's layers and
        process-wide kernel settings; raises ValueError where the weights do not fit the
        --quantization asked for. Default: the weights stay as loaded."""

    def pads_decode_batches(self) -> bool:
        """Whether the step runner pads batches with rows of their own: then the KV pool gets a padding
        page and the request table a padding row that are never allocated (mem_cache/kv_pool.py),
        the page out of the KV budget. Default: no, and no byte more."""
        return False

    def step_runner(self, model: CausalLM, attn_backend: AttentionBackend, memory: KVMemory) -> StepRunner:
        """The runner ModelRunner asks for each batch, not yet prepared. Called once."""
        return NoStepRunner()

    def state(self) -> dict[str, Any]:
        """What the steps run on now, for /server_info. Mutates nothing."""
        return {"cpu_threads": {"configured": torch.get_num_threads(), "adaptive": False}}

    def restore_threads(self) -> None:
        """The offline Engine's call is over: the caller's torch threads as it set them, whatever the
        wing chose per step. Default: the wing never changes them."""


def _cpu(config: RunnerConfig, parallel: ParallelState) -> DeviceWing:
    from model_executor.cpu.wing import CpuWing  # imports this module: the base above

    return CpuWing(config, parallel)


def _cuda(config: RunnerConfig, parallel: ParallelState) -> DeviceWing:
    from model_executor.cuda.wing import CudaWing  # imports this module: the base above

    return CudaWing(config, parallel)


def host_fused_ops() -> FusedOps:
    """The fused ops of a process no wing has chosen for (a model built outside a ModelRunner): the
    CPU's, whose kernels take CPU tensors only and leave any other to torch."""
    from model_executor.cpu.fused_ops import CpuFusedOps

    return CpuFusedOps()


DEVICE_WINGS: dict[str, Callable[[RunnerConfig, ParallelState], DeviceWing]] = {"cpu": _cpu, "cuda": _cuda}


def device_wing(config: RunnerConfig, parallel: ParallelState) -> DeviceWing:
    """The wing of `config.device`'s type; the base where that type has none."""
    return DEVICE_WINGS.get(torch.device(config.device).type, DeviceWing)(config, parallel)
