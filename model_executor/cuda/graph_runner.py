"""CudaGraphRunner: decode steps replayed from CUDA graphs, one per batch size of its GraphPlan.

prepare() allocates static inputs at the largest size and captures, largest first into one shared
memory pool, the attention backend's init_forward_metadata and the model's forward over a
ForwardBatch of slices of those inputs. run() copies a batch's tensors in, pads the rest of its size
with the padding rows (graph_plan.py), replays and returns the batch's rows. The backend must read
only the batch's device tensors (AttentionBackend.supports_cuda_graph): a graph replays the kernels
it captured with the lengths of whatever batch is in the static inputs.

Capture and replay go through `GraphCapture`, so the bookkeeping runs on the CPU in tests (with an
eager stand-in that re-runs the function on each replay).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from mem_cache.kv_memory import KVMemory
from model_executor.attention.base import AttentionBackend
from model_executor.cuda.graph_plan import GraphPlan, Padding
from model_executor.distributed.pipeline import StageOutput
from model_executor.forward_batch import ForwardBatch, ForwardMode
from model_executor.layers.moe import SparseMoeBlock
from model_executor.models.base import CausalLM
from model_executor.step_runner import StepRunner

logger = logging.getLogger("srt.cuda_graph")

_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
_PAD_OF = {
    "input_ids": "input_id",
    "positions": "position",
    "req_pool_indices": "req_pool_index",
    "seq_lens": "seq_len",
    "out_cache_loc": "out_cache_loc",
}


class Replayable(Protocol):
    def replay(self) -> torch.Tensor:
        """Runs the captured work again; returns its output tensor (the same one every replay)."""
        ...


class GraphCapture(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Replayable:
        """Warms `fn` up and captures it."""
        ...


class _CudaReplay:
    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class CudaGraphCapture:
    """torch.cuda.graph, every graph in one memory pool: captured largest first, the smaller ones
    reuse the larger's memory (only one replays at a time)."""

    def __init__(self, warmups: int = 2) -> None:
        self.warmups = warmups
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replayable:
        stream = torch.cuda.Stream()  # warm-up off the default stream, as torch's docs ask
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmups):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return _CudaReplay(graph, out)


def declines_all(
    model: CausalLM, attn_backend: AttentionBackend, *, tp_size: int, pp_size: int
) -> str | None:
    """Why no graph can hold this rank's decode steps, or None. A pipeline stage other than the
    last hands a StageOutput over (received before and sent after the forward, not captured);
    mixture-of-experts layers count tokens per expert on the host (and record routed experts);
    NCCL collectives inside a graph are not yet tried here."""
    if pp_size > 1:
        return "--pp-size > 1: a stage's hand-over is not captured"
    if tp_size > 1:
        return "--tp-size > 1: collectives inside a graph are not supported yet"
    if not attn_backend.supports_cuda_graph:
        return f"the attention backend {type(attn_backend).__name__} reads host values per step"
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return "mixture-of-experts layers route on the host"
    return None


class CudaGraphRunner(StepRunner):
    gpu_path = "cuda_graph"

    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        memory: KVMemory,
        sizes: list[int],
        *,
        device: torch.device,
        tp_size: int = 1,
        pp_size: int = 1,
        graphs: GraphCapture | None = None,
    ) -> None:
        padding_row, padding_slot = memory.req_to_token_pool.padding_row, memory.kv_pool.padding_slot
        assert padding_row is not None and padding_slot is not None, "the KV memory has no padding page"
        self.model, self.attn_backend, self.memory, self.device = model, attn_backend, memory, device
        self.plan = GraphPlan(tuple(sizes), Padding(req_pool_index=padding_row, out_cache_loc=padding_slot))
        self.declined = declines_all(model, attn_backend, tp_size=tp_size, pp_size=pp_size)
        self._capture = graphs
        self._graphs: dict[int, Replayable] = {}
        self._batches: dict[int, ForwardBatch] = {}
        self._static: dict[str, torch.Tensor] = {}
        self._warned_invalid = False

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def prepare(self) -> None:
        if self.declined is not None:
            return
        # The padding row attends over the padding slot alone (graph_plan.py).
        self.memory.req_to_token_pool.req_to_token[self.plan.padding.req_pool_index, 0] = (
            self.plan.padding.out_cache_loc
        )
        size = self.plan.max_bs
        self._static = {
            f: torch.full(
                (size,), getattr(self.plan.padding, _PAD_OF[f]), dtype=torch.int64, device=self.device
            )
            for f in _FIELDS
        }
        capture = self._capture if self._capture is not None else CudaGraphCapture()
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                for bs in reversed(self.plan.sizes):  # largest first: the smaller reuse its pool memory
                    static = {f: t[:bs] for f, t in self._static.items()}
                    batch = ForwardBatch(
                        mode=ForwardMode.DECODE,
                        input_ids=static["input_ids"],
                        positions=static["positions"],  # rotary table rows: the live batch's are copied in
                        req_pool_indices=static["req_pool_indices"],
                        seq_lens=static["seq_lens"],
                        out_cache_loc=static["out_cache_loc"],
                        seq_lens_cpu=[1] * bs,  # placeholders: a capture-safe backend never reads them
                        extend_prefix_lens_cpu=[0] * bs,
                        extend_seq_lens_cpu=[1] * bs,
                        attn_backend=self.attn_backend,
                    )
                    self._batches[bs] = batch
                    self._graphs[bs] = capture.capture(self._step_fn(batch))
        except RuntimeError as error:  # a kernel that cannot be captured: decode runs eagerly, and says why
            self._graphs.clear()
            self._batches.clear()
            self.declined = f"capturing a CUDA graph failed: {error}"
            logger.error("decode steps run without CUDA graphs: %s", self.declined)
            return
        self.plan.record(self._bound())
        logger.info(
            "captured CUDA graphs of decode batch sizes %s in %.1f s",
            self.captured,
            time.perf_counter() - start,
        )

    def _step_fn(self, batch: ForwardBatch) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            self.attn_backend.init_forward_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions, batch, None)
            assert isinstance(hidden, torch.Tensor)
            return hidden

        return step

    def _bound(self) -> tuple[tuple[str, int], ...]:
        """The tensors the graphs address outside their own pool: the KV buffers, the request
        table, and the attention backend (by identity: its scratch is its own)."""
        pool = self.memory.kv_pool
        kv = [
            (f"kv{i}.{n}", t.data_ptr())
            for i in range(pool.num_layers)
            for n, t in zip("kv", pool.get_kv_buffer(i))
        ]
        return (
            ("attn_backend", id(self.attn_backend)),
            ("req_to_token", self.memory.req_to_token_pool.req_to_token.data_ptr()),
            *kv,
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        if not self._graphs or not batch.is_decode or self.plan.bucket_for(batch.batch_size) is None:
            return False
        if batch.attn_backend is not None and batch.attn_backend is not self.attn_backend:
            return False
        if not self.plan.still_valid(self._bound()):
            if not self._warned_invalid:
                logger.warning(
                    "the KV memory moved since the CUDA graphs were captured: decoding without them"
                )
                self._warned_invalid = True
            return False
        return True

    def begin_step(self, batch: ForwardBatch, runs: bool) -> None:
        pass

    def run(self, batch: ForwardBatch) -> torch.Tensor | StageOutput:
        """The final hidden states [bs, hidden]: a view of the graph's output, valid until the next
        replay (ModelRunner turns it into logits before the next step; a copy would cost a
        [bs, hidden] write a step for nothing)."""
        bs = batch.batch_size
        size = self.plan.bucket_for(bs)
        assert batch.is_decode and size is not None, "a batch can_run declined"
        for f, static in self._static.items():
            static[:bs].copy_(getattr(batch, f), non_blocking=True)
            if size > bs:
                static[bs:size].fill_(getattr(self.plan.padding, _PAD_OF[f]))
        graph_batch = self._batches[size]
        # Only an eager stand-in (tests) reads these: a captured backend never does.
        graph_batch.seq_lens_cpu = self.plan.padded(batch.seq_lens_cpu, size, "seq_len")
        graph_batch.extend_prefix_lens_cpu = [n - 1 for n in graph_batch.seq_lens_cpu]
        return self._graphs[size].replay()[:bs]
