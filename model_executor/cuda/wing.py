"""CudaWing: the CUDA device's DeviceWing. Each rank's process works on its own GPU; decode steps
replay CUDA graphs (graph_runner.py) unless --disable-cuda-graph, where the attention backend's
decode path can be captured."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from mem_cache.kv_memory import KVMemory
from model_executor.attention.base import AttentionBackend
from model_executor.cuda.graph_plan import capture_sizes
from model_executor.cuda.graph_runner import CudaGraphRunner, declines_all
from model_executor.device_wing import DeviceWing
from model_executor.distributed.parallel_state import ParallelState
from model_executor.models.base import CausalLM
from model_executor.step_runner import NoStepRunner, StepRunner

if TYPE_CHECKING:
    from model_executor.model_runner import RunnerConfig

logger = logging.getLogger("srt.cuda_graph")


class CudaWing(DeviceWing):
    def __init__(self, config: RunnerConfig, parallel: ParallelState) -> None:
        super().__init__(config, parallel)
        device = torch.device(config.device)
        if device.index is not None and torch.cuda.is_available():
            torch.cuda.set_device(device)  # streams, graphs and NCCL then default to the rank's GPU
        self.runner: CudaGraphRunner | None = None
        self.disabled: str | None = "--disable-cuda-graph" if config.disable_cuda_graph else None

    def pads_decode_batches(self) -> bool:
        return not self.config.disable_cuda_graph

    def step_runner(self, model: CausalLM, attn_backend: AttentionBackend, memory: KVMemory) -> StepRunner:
        if self.disabled is None:
            self.disabled = declines_all(
                model, attn_backend, tp_size=self.parallel.tp.world_size, pp_size=self.parallel.pp.world_size
            )
        if self.disabled is not None:
            if not self.config.disable_cuda_graph:
                logger.info("decode steps run without CUDA graphs: %s", self.disabled)
            return NoStepRunner()
        sizes = capture_sizes(
            self.config.cuda_graph_max_bs, self.config.cuda_graph_bs, self.config.max_running_requests
        )
        self.runner = CudaGraphRunner(
            model,
            attn_backend,
            memory,
            sizes,
            device=torch.device(self.config.device),
            tp_size=self.parallel.tp.world_size,
            pp_size=self.parallel.pp.world_size,
        )
        return self.runner

    def state(self) -> dict[str, Any]:
        """The CUDA graphs: the decode batch sizes captured, or why there are none."""
        graphs: dict[str, Any] = {"captured_batch_sizes": self.runner.captured if self.runner else []}
        disabled = self.disabled or (self.runner.declined if self.runner else None)
        if disabled is not None:
            graphs["disabled"] = disabled
        return {"cuda_graphs": graphs}
