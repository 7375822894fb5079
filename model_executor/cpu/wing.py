"""CpuWing: the CPU's DeviceWing. The layers' fused ops run on our kernels (fused_ops.py); glibc
keeps freed memory and oneDNN's caches are bounded (memory.py); --quantization is checked and the
weights packed for the kernels (weights.py); the step runner is the fused decode runner, or an
encoder's fused layers (encoder_runner.py), which with adaptive threads also apply the thread
governor's count (decode_runner.py, thread_governor.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mem_cache.kv_memory import KVMemory
from model_executor.attention.base import AttentionBackend
from model_executor.cpu.decode_runner import CpuDecodeRunner
from model_executor.cpu.encoder_runner import CpuEncoderRunner
from model_executor.cpu.fused_ops import CpuFusedOps
from model_executor.cpu.kernels import ops
from model_executor.cpu.memory import bound_onednn_caches, keep_freed_memory, release_freed_memory
from model_executor.cpu.thread_governor import ThreadGovernor
from model_executor.cpu.weights import Packer, check_quantization, loading_packer, prepare_weights
from model_executor.device_wing import DeviceWing
from model_executor.distributed.parallel_state import ParallelState
from model_executor.layers.fused_ops import FusedOps
from model_executor.loader.gguf_convert import gguf_source
from model_executor.models.base import CausalLM
from model_executor.step_runner import StepRunner

if TYPE_CHECKING:
    from model_executor.model_runner import RunnerConfig


class CpuWing(DeviceWing):
    def __init__(self, config: RunnerConfig, parallel: ParallelState) -> None:
        super().__init__(config, parallel)
        if config.deterministic or config.fixed_order_sum:  # a row's bits must not depend on its batch
            ops.exact_rows = True  # for the process: a draft model's runner does not turn it off
        keep_freed_memory()
        bound_onednn_caches()
        self.packer: Packer | None = None  # packing each weight while the checkpoint loads
        # Set by step_runner with adaptive threads (--disable-adaptive-cpu-threads off).
        self.thread_governor: ThreadGovernor | None = None

    def fused_ops(self) -> FusedOps:
        return CpuFusedOps()

    def check(self) -> None:
        check_quantization(self.config.quantization, self.config.dtype, self.config.device)

    def batch_invariant(self) -> bool:
        return self.config.quantization != "gguf" or ops.gguf_every_row()

    def load_hooks(self, model: CausalLM) -> Packer | None:
        gguf_file = gguf_source(self.config.model_dir)
        self.packer = loading_packer(
            model,
            quantization=self.config.quantization,
            deterministic=self.config.deterministic,
            gguf_file=gguf_file,
            config=json.loads((Path(self.config.model_dir) / "config.json").read_text())
            if gguf_file
            else None,
        )
        return self.packer

    def prepare_weights(self, model: CausalLM, load_float32: Callable[[], CausalLM]) -> None:
        prepare_weights(
            model,
            quantization=self.config.quantization,
            dtype=self.config.dtype,
            deterministic=self.config.deterministic,
            load_float32=load_float32,
            gguf_file=gguf_source(self.config.model_dir),
            packer=self.packer,
        )
        self.packer = None
        release_freed_memory()  # the weights packing replaced, before the KV budget reads free memory

    def step_runner(self, model: CausalLM, attn_backend: AttentionBackend, memory: KVMemory) -> StepRunner:
        self.thread_governor = ThreadGovernor.for_this_rank() if self.config.adaptive_threads else None
        if not model.is_causal:
            return CpuEncoderRunner(
                model,
                tp_size=self.parallel.tp.world_size,
                pp_size=self.parallel.pp.world_size,
                thread_governor=self.thread_governor,
            )
        return CpuDecodeRunner(
            model,
            attn_backend,
            tp_size=self.parallel.tp.world_size,
            pp_size=self.parallel.pp.world_size,
            deterministic=self.config.deterministic,
            thread_governor=self.thread_governor,
        )

    def state(self) -> dict[str, Any]:
        """The torch threads: configured, and with the governor on, what the steps in our kernels run
        on now and the cores other processes kept busy in its last window."""
        gov = self.thread_governor
        if gov is None:
            return super().state()
        return {
            "cpu_threads": {
                "configured": gov.threads,
                "adaptive": True,
                "governed": gov.current,
                "others_busy_cores": gov.others,
            }
        }

    def restore_threads(self) -> None:
        if self.thread_governor is not None:
            self.thread_governor.restore()
