"""ModelRunner: owns the model, its KV memory and the sampler of one rank.

forward batch -> logits of each request's last token -> sampled ids.

Device-neutral: what a device adds (weight layouts for its kernels, a step runner for the batches
it runs faster than the layers op by op) comes from its wing (device_wing.py; the CPU's is cpu/).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mem_cache.allocator import PageAllocator
from mem_cache.budget import KVBudget, kv_budget, kv_bytes_per_token
from mem_cache.kv_memory import KVMemory
from mem_cache.kv_pool import PagedKVPool
from mem_cache.req_to_token_pool import ReqToTokenPool
from mem_cache.window_pages import WindowPages
from model_executor.attention.base import AttentionBackend
from model_executor.attention.registry import create_attention_backend, resolve_attention_backend
from model_executor.device_wing import device_wing
from model_executor.distributed.parallel_state import ParallelState, get_parallel_state
from model_executor.distributed.pipeline import PipelineStage, StageLink, StageOutput, lm_head_cost_in_layers
from model_executor.forward_batch import ForwardBatch
from model_executor.gpu_status import gpu_paths_in_use, warn_unverified_gpu_paths
from model_executor.layers.attention import Attention
from model_executor.layers.moe import SparseMoeBlock
from model_executor.layers.rotary import long_rope, rope_parameters
from model_executor.loader.load_weights import load_weights
from model_executor.loader.weight_source import eos_token_ids, iter_checkpoint, load_hf_config
from model_executor.logits_processor import process_logits, score_tokens
from model_executor.lora.adapters import LoraAdapters
from model_executor.models.base import CausalLM
from model_executor.models.registry import get_model_class
from model_executor.pooler import Pooler
from model_executor.routed_experts import RouteCapture
from model_executor.sampler import Sampler
from model_executor.sampling_inputs import SamplingInputs, StepOutput
from model_executor.step_runner import NoStepRunner, StepRunner
from srt.lora_config import LoraRef
from srt.weight_checkpoint import check_checkpoint

logger = logging.getLogger("srt.model_runner")


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: Path
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    page_size: int = 1
    mem_fraction_static: float | None = None  # None: not given (mem_cache/budget.py has the rule)
    max_total_tokens: int | None = None
    cpu_kvcache_space: float | None = None  # GiB for every rank of the host together; None: the default
    max_running_requests: int = 256
    context_length: int | None = None
    attention_backend: str = "auto"  # attention/registry.py: ATTENTION_BACKENDS or "auto"
    local_world_size: int = 1  # ranks on this host: they share its free memory
    quantization: str | None = (
        None  # "w8a8_int8" or "gguf" (cpu/weights.py QUANTIZATIONS) or None: the weights as loaded
    )
    deterministic: bool = False  # one arithmetic for prefill and decode (--enable-deterministic-inference)
    # TP all-reduces sum ranks in a fixed order whatever a step's size (on with `deterministic`, and
    # with speculative decoding, whose verify rows must get a plain decode row's bits)
    fixed_order_sum: bool = False
    adaptive_threads: bool = False  # fewer threads while others load the CPUs (cpu/thread_governor.py)
    return_routed_experts: bool = False  # keep every token's experts (--enable-return-routed-experts)
    is_embedding: bool = False  # pool each prompt into an embedding instead of sampling (--is-embedding)
    # sliding-window layers' K/V in window pages (mem_cache/window_pages.py): window pages per full page,
    # and whether they are off (--swa-full-tokens-ratio, --disable-hybrid-swa-memory)
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    chunked_prefill_size: int = 2048  # new tokens of one request in one step (sizes the window pages' floor)
    # CUDA graphs of decode steps (model_executor/cuda/): None/None: the default sizes
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    disable_cuda_graph: bool = False
    # LoRA (--enable-lora): the adapters loaded at start, ids 1, 2, ... in order; None: LoRA off
    lora_adapters: tuple[LoraRef, ...] | None = None
    max_lora_rank: int | None = None


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights in memory: its parameters (not those freed to their shape, on the
    meta device) and the copies its linear methods read (packed for a device's kernels)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        packed = method.packed_weight if method is not None else None
        parts = (
            [packed] if isinstance(packed, torch.Tensor) else list(vars(packed).values()) if packed else []
        )
        total += sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
    return total


@dataclass(frozen=True)
class RunnerInfo:
    """What the runner tells its scheduler once loaded; the rank's ready message carries it to the
    front end as a dict (`asdict`), under these names."""

    max_total_tokens: int
    num_pages: int
    kv_budget: str  # the budget's one-line description, as logged
    page_size: int
    context_length: int
    long_rope_original: int | None  # LongRoPE: prompts longer than this run on the long factors throughout
    weight_bytes: int
    vocab_size: int
    hidden_size: int  # an embedding's size (--is-embedding)
    cross_encoder: bool  # the model scores pairs: /v1/rerank
    max_running_requests: int
    eos_token_ids: list[int]
    # a row's outputs are the same bits whatever else its batch holds (the wing's kernels, with
    # --quantization): what speculation's verify steps need
    batch_invariant: bool


class ModelRunner:
    def __init__(self, config: RunnerConfig, parallel: ParallelState | None = None) -> None:
        self.config = config
        self.parallel = parallel or get_parallel_state()
        self.device = torch.device(config.device)
        self.wing = device_wing(config, self.parallel)  # what the device adds (model_executor/device_wing.py)
        self.hf_config = load_hf_config(config.model_dir)
        self.long_rope = long_rope(
            rope_parameters(self.hf_config),
            int(getattr(self.hf_config, "max_position_embeddings", 0) or 4096),
        )
        self.context_length = self._context_length()
        self._init_model()
        self._init_memory()
        self._init_attention_backend()
        self._init_step_runner()
        self.sampler = Sampler()

    def _context_length(self) -> int:
        model_len = int(getattr(self.hf_config, "max_position_embeddings", 0) or 4096)
        what = "max_position_embeddings"
        if self.config.is_embedding:  # sentence-transformers' own limit, where the checkpoint has one
            st_config = self.config.model_dir / "sentence_bert_config.json"
            if st_config.exists():
                model_len = min(
                    model_len, int(json.loads(st_config.read_text()).get("max_seq_length") or model_len)
                )
        wanted = self.config.context_length
        if wanted is None:
            return model_len
        if wanted < 1:
            raise ValueError(f"--context-length must be positive, got {wanted}")
        if wanted > model_len:
            raise ValueError(f"--context-length {wanted} exceeds the model's {what} ({model_len})")
        return wanted

    def _init_model(self) -> None:
        start = time.perf_counter()
        self.wing.check()
        model_cls = get_model_class(self.hf_config)
        model_cls.check_config(self.hf_config, self.context_length)  # refuses, by name, what it lacks
        pp = self.parallel.pp
        if not model_cls.is_causal and not self.config.is_embedding:
            raise ValueError(f"{model_cls.__name__} is an encoder: it serves embeddings, with --is-embedding")
        if self.config.is_embedding and pp.world_size > 1:
            raise ValueError("--is-embedding runs with --pp-size 1")
        self.pooler = Pooler.of_checkpoint(self.config.model_dir) if self.config.is_embedding else None
        self.stage = PipelineStage.of(
            int(self.hf_config.num_hidden_layers),
            pp.rank_in_group,
            pp.world_size,
            lm_head_cost_in_layers(self.hf_config),
        )
        self.stage_link = StageLink(pp) if pp.world_size > 1 else None
        self.parallel.tp.fixed_order_sum = self.config.deterministic or self.config.fixed_order_sum
        self.model: CausalLM = self._load_model(self.config.model_dir)
        self.moe_blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        self.lora: LoraAdapters | None = None  # with --enable-lora: every adaptable layer's adapters
        if self.config.lora_adapters is not None:
            self.lora = LoraAdapters(
                self.model,
                self.config.lora_adapters,
                self.device,
                self.config.max_lora_rank,
                row_by_row=self.config.deterministic,
            )
        self.weight_bytes = model_weight_bytes(self.model)
        layers = (
            "" if self.stage.size == 1 else f", layers {self.stage.start_layer}-{self.stage.end_layer - 1}"
        )
        logger.info(
            "loaded %s (%.1f MB on this rank%s, %s) in %.1f s",
            model_cls.__name__,
            self.weight_bytes / 2**20,
            layers,
            self.config.dtype,
            time.perf_counter() - start,
        )

    def _load_model(self, model_dir: Path) -> CausalLM:
        """A new model of this rank's stage with `model_dir`'s weights, laid out by the wing."""
        model_cls = get_model_class(self.hf_config)
        with torch.device(self.device):
            model = model_cls(self.hf_config, self.parallel.tp, self.config.dtype, self.stage)
        load_weights(
            model,
            iter_checkpoint(model_dir),
            progress=self.parallel.world.is_first,
            hooks=self.wing.load_hooks(model),
        )
        model.eval()

        def load_float32() -> CausalLM:  # the checkpoint's exact values, for a layout that needs them
            with torch.device(self.device):
                exact = model_cls(self.hf_config, self.parallel.tp, torch.float32, self.stage)
            load_weights(exact, iter_checkpoint(model_dir))
            return exact

        self.wing.prepare_weights(model, load_float32)
        return model

    def stage_weights(self, model_dir: Path) -> Callable[[], None]:
        """Loads this rank's shard of `model_dir` (a safetensors folder of the running model's
        architecture and config) into a new model beside the serving one, which keeps serving.
        Returns the commit that swaps it in (between steps); dropping it drops the new weights.
        ValueError or OSError names the cause (scheduler/weight_registry.py agrees on it)."""
        check_checkpoint(model_dir, self.config.model_dir)
        if self.lora is not None or self.routes is not None or self.config.quantization == "gguf":
            raise ValueError(
                "update_weights_from_disk runs without --enable-lora, --enable-return-routed-experts "
                "and --quantization gguf (whose linears would be read from the running GGUF file)"
            )
        model = self._load_model(model_dir)

        def commit() -> None:
            self.model = model
            self.moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
            self.config = dataclasses.replace(self.config, model_dir=model_dir)
            self._init_step_runner()  # the fused paths lay out the new weights (CUDA graphs: recaptured)

        return commit

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def _window_layout(self) -> tuple[int, frozenset[int]] | None:
        """(the widest window, this stage's pool layers that keep window pages), or None: every
        layer's K/V in full pages (no window, one wider than the context, or
        --disable-hybrid-swa-memory). Decided from every stage's layers, so every rank agrees."""
        windows = [w for w in self.model.attention_windows() if w]
        if self.config.disable_hybrid_swa_memory or not windows or max(windows) >= self.context_length:
            return None
        layers = frozenset(
            m.layer_id for m in self.model.modules() if isinstance(m, Attention) and m.sliding_window
        )
        return max(windows), layers

    def _init_memory(self) -> None:
        num_layers, kv_heads, head_dim = self.model.kv_cache_layout()
        padding = self.wing.pads_decode_batches()  # a spare KV page and request row, never allocated
        window = None if padding else self._window_layout()  # (a CUDA graph's padding page is a full page)
        ratio = self.config.swa_full_tokens_ratio
        local = len(window[1]) if window else 0
        # a full slot costs its global layers' K/V and `ratio` of a window slot
        layer_bytes = kv_bytes_per_token(1, kv_heads, head_dim, self.config.dtype)
        per_token = (num_layers - local) * layer_bytes + math.ceil(ratio * local * layer_bytes)
        page_size = self.config.page_size
        config = self.config
        self.kv_budget: KVBudget = kv_budget(
            device=self.device,
            bytes_per_token=per_token,
            page_size=page_size,
            local_world_size=config.local_world_size,
            mem_fraction_static=config.mem_fraction_static,
            max_total_tokens=config.max_total_tokens,
            cpu_kvcache_space=config.cpu_kvcache_space,
            max_running_requests=config.max_running_requests,
            context_length=self.context_length,
            cpu_group=self.parallel.world.cpu_group,
            padding_pages=int(padding),
        )
        self.num_pages = self.kv_budget.num_pages
        self.max_total_tokens = self.num_pages * page_size
        self.max_running_requests = self.config.max_running_requests
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests,
            self.context_length + page_size,
            device=self.device,
            padding_row=padding,
        )
        self.window_pages: WindowPages | None = None
        if window is not None:
            # at least a lone request's widest step: a chunk, the window before it, two part pages
            floor = -(-(min(config.chunked_prefill_size, self.context_length) + window[0]) // page_size) + 2
            self.window_pages = WindowPages(
                num_full_pages=self.num_pages,
                num_pages=min(self.num_pages, max(math.ceil(ratio * self.num_pages), floor)),
                page_size=page_size,
                window=window[0],
                table_rows=self.req_to_token_pool.req_to_token.shape[0],
                max_context_len=self.req_to_token_pool.max_context_len,
                device=self.device,
            )
        self.kv_pool = PagedKVPool(
            self.num_pages,
            page_size,
            num_layers,
            kv_heads,
            head_dim,
            self.config.dtype,
            self.device,
            padding_page=padding,
            window_layers=window[1] if window else frozenset(),
            window_pages=self.window_pages.num_pages if self.window_pages else 0,
        )
        self.allocator = PageAllocator(self.num_pages, page_size, device=self.device)
        self.routes: RouteCapture | None = None
        if config.return_routed_experts:
            if self.parallel.pp.world_size > 1:
                raise ValueError(
                    "--enable-return-routed-experts runs with --pp-size 1 (each stage routes its own layers)"
                )
            layers = int(self.hf_config.num_hidden_layers)
            self.routes = RouteCapture(self.model, self.moe_blocks, self.kv_pool.num_slots, layers)
        self.memory = KVMemory(
            self.req_to_token_pool,
            self.kv_pool,
            self.allocator,
            self.kv_budget,
            self.routes.pool if self.routes is not None else None,
            self.window_pages,
        )
        if self.parallel.world.is_first:
            logger.info("%s; %d request slots", self.kv_budget.describe(), self.max_running_requests)
            if self.window_pages is not None:
                logger.info(
                    "window pages: %d layers of this stage keep %d tokens (%g of the full pages, at least "
                    "a %d-token window and a chunk); --swa-full-tokens-ratio sets it",
                    local,
                    self.window_pages.num_pages * page_size,
                    ratio,
                    self.window_pages.window,
                )

    def _init_attention_backend(self) -> None:
        backend = resolve_attention_backend(self.config.attention_backend, self.device, self.config.dtype)
        self.attn_backend_name = backend
        self.attn_backend: AttentionBackend = create_attention_backend(
            backend,
            self.device,
            self.kv_pool,
            self.req_to_token_pool.req_to_token,
            self.config.deterministic,
        )
        windows = sorted(
            {m.sliding_window for m in self.model.modules() if isinstance(m, Attention) and m.sliding_window}
        )
        if windows and not self.attn_backend.supports_sliding_window:
            raise ValueError(
                f"--attention-backend {backend} has no sliding-window attention, which this model's "
                f"layers use (windows of {windows} tokens); use --attention-backend torch_native"
            )
        if self.window_pages is not None:
            self.attn_backend.use_window_pages(self.window_pages.req_to_token)
        if self.config.deterministic:
            logger.info(
                "deterministic inference: %s",
                "every token on the decode kernel's arithmetic, prefill or decode, in any batch"
                if self.attn_backend.decode_rows_extend
                else "NOT exact here: prefill and decode share one arithmetic only on the bf16 CPU kernels "
                f"(this rank runs {self.config.dtype} on {self.device.type}, "
                f"attention backend {self.config.attention_backend})",
            )

    def _init_step_runner(self) -> None:
        # With LoRA on, a step runner that adds no adapter's product (CUDA graphs) runs nothing: every
        # batch then runs the layers op by op, adapters or not, as a base row must take the same path
        # in a batch with adapters as in one without (its tokens never depend on its batch).
        self.step_runner: StepRunner = self.wing.step_runner(self.model, self.attn_backend, self.memory)
        if self.lora is not None and not self.step_runner.takes_lora:
            self.step_runner = NoStepRunner()
        self.step_runner.prepare()
        if self.parallel.world.is_first:
            paths = gpu_paths_in_use(self.device, self.attn_backend_name, self.parallel.world.world_size)
            paths += [self.step_runner.gpu_path] if self.step_runner.gpu_path else []
            warn_unverified_gpu_paths(self.device, paths)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the model; returns float32 logits [bs, vocab] of each request's last new token."""
        return self.forward_with_token_logits(batch, None)[0]

    @torch.inference_mode()
    def forward_with_token_logits(
        self, batch: ForwardBatch, token_rows: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(), plus float32 logits [len(token_rows), vocab] of the given new tokens (indices
        into the step's flattened new tokens; prompt logprobs need them). The LM head runs once
        over both sets of rows. Every rank must pass the same rows (the head is a TP collective).
        Single-stage only; a pipeline stage calls forward_stage."""
        logits = self.forward_stage(batch, token_rows)
        assert logits is not None, "not the last pipeline stage"
        return logits

    @torch.inference_mode()
    def forward_stage(
        self, batch: ForwardBatch, token_rows: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """This stage's part of the step: on the step runner where it takes the batch, else op by op
        (receiving the previous stage's hand-over unless first); then either sends the hand-over on
        (-> None) or, on the last stage, returns the logits as forward_with_token_logits does."""
        self._rope_rows(batch)
        batch.attn_backend = self.attn_backend
        if self.window_pages is not None:
            batch.window_cache_loc = self.window_pages.translate(batch.out_cache_loc)
            if bool((batch.window_cache_loc == self.window_pages.null_slot).any()):
                raise RuntimeError(
                    "KV slots without window pages: allocate through KVMemory.alloc_extend, which gives "
                    "each full page its window page"
                )
        if self.routes is not None:
            self.routes.begin(batch.out_cache_loc)
        if self.lora is not None:
            self.lora.begin(batch)
        runs = self.step_runner.can_run(batch)
        self.step_runner.begin_step(batch, runs)
        if runs:
            hidden: torch.Tensor | StageOutput = self.step_runner.run(batch)
        else:
            self.attn_backend.init_forward_metadata(batch)
            previous = None
            if self.stage_link is not None and not self.stage.is_first:
                previous = self.stage_link.recv_stage_output(
                    batch.num_tokens, int(self.hf_config.hidden_size), self.device
                )
            hidden = self.model(batch.input_ids, batch.positions, batch, previous)
        if isinstance(hidden, StageOutput):
            assert self.stage_link is not None
            self.stage_link.send_stage_output(hidden)
            return None
        last = (
            hidden
            if batch.is_decode
            else hidden[torch.tensor(batch.extend_seq_lens_cpu, device=hidden.device).cumsum(0) - 1]
        )
        if not token_rows:
            return self.model.compute_logits(last), None
        extra = hidden[torch.tensor(token_rows, dtype=torch.int64, device=hidden.device)]
        logits = self.model.compute_logits(torch.cat([last, extra]))
        return logits[: batch.batch_size], logits[batch.batch_size :]

    def _rope_rows(self, batch: ForwardBatch) -> None:
        """With LongRoPE's long factors, the batch's positions become rows of the rotary tables (the
        long ones past the short: layers/rotary.py LongRope), once; positions feed the rotary only."""
        if self.long_rope is None or batch.rope_rows:
            return
        prompts = batch.prompt_lens_cpu if batch.prompt_lens_cpu is not None else batch.seq_lens_cpu
        batch.positions = self.long_rope.rows(batch.positions, prompts, batch.extend_seq_lens_cpu)
        batch.rope_rows = True

    @torch.inference_mode()
    def embed(self, batch: ForwardBatch) -> list[list[float]]:
        """The embedding of each request of a prefill batch whose prompts are whole (--is-embedding):
        the model's final hidden states pooled (model_executor/pooler.py), float32."""
        assert self.pooler is not None, "not an embedding runner"
        assert not any(batch.extend_prefix_lens_cpu), "an embedding pools a whole prompt"
        self._rope_rows(batch)
        batch.attn_backend = self.attn_backend
        runs = self.step_runner.can_run(batch)
        self.step_runner.begin_step(batch, runs)
        if runs:
            hidden = self.step_runner.run(batch)
        else:
            self.attn_backend.init_forward_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions, batch, None)
        assert isinstance(hidden, torch.Tensor)
        pool = getattr(self.model, "pool", self.pooler)  # a cross-encoder scores its pairs itself
        embeddings: list[list[float]] = pool(hidden, batch.extend_seq_lens_cpu).tolist()
        return embeddings

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, inputs: SamplingInputs) -> StepOutput | None:
        """The one call per step from the scheduler: runs this stage's part of the forward and, on the
        last stage, processes the logits, samples, agrees on the ids over TP when `inputs` asks, sends
        them to the earlier stages and scores the logprobs. None on an earlier pipeline stage: its
        ids come back from the last stage later (`receive_ids`). Every rank must pass the same inputs
        (the forward and the sync are collectives). An embedding runner (--is-embedding) pools each
        prompt instead and samples nothing."""
        if self.pooler is not None:
            return StepOutput([0] * batch.batch_size, embeddings=self.embed(batch))
        out = self.forward_stage(batch, inputs.logprobs.token_rows if inputs.logprobs else None)
        if out is None:
            return None
        logits, token_logits = out
        next_ids = self.sampler(
            process_logits(logits, inputs, self.vocab_size), inputs.batch_info(self.device)
        )
        if inputs.corrupt_ids is not None:
            inputs.corrupt_ids(next_ids)
        if inputs.sync_across_tp:
            # Ranks may sample differently (non-deterministic kernels, bit flips): agree on MIN.
            self.parallel.tp.all_reduce(next_ids, op=torch.distributed.ReduceOp.MIN)
        if self.stage_link is not None:
            self.stage_link.send_ids(next_ids)  # every earlier stage needs them
        ids: list[int] = next_ids.tolist()
        rows = inputs.logprobs
        scored = score_tokens(rows, logits, token_logits, ids) if rows is not None and rows.compute else None
        return StepOutput(ids, scored)

    def receive_ids(self, batch_size: int) -> list[int]:
        """On an earlier pipeline stage: the ids the last stage sampled for a step launched before,
        in launch order."""
        assert self.stage_link is not None and not self.stage.is_last, "only earlier stages receive ids"
        ids: list[int] = self.stage_link.recv_ids(batch_size).tolist()
        return ids

    def set_lora_adapter(self, adapter_id: int, ref: LoraRef | None) -> None:
        """With --enable-lora: attaches this rank's shard of `ref` as adapter `adapter_id`, or with
        None drops that id (scheduler/lora_registry.py decides both, the same on every rank).
        ValueError or OSError naming the cause leaves the layers unchanged."""
        if self.lora is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if ref is None:
            self.lora.unload(adapter_id)
        else:
            self.lora.load(adapter_id, ref)

    def state(self) -> dict[str, Any]:
        """What the steps run on now, for /server_info (the device wing's: on the CPU, the threads),
        and with experts the tokens routed to each since start, summed over this rank's layers."""
        state = self.wing.state()
        if self.moe_blocks:
            tokens = torch.stack([b.expert_tokens for b in self.moe_blocks]).sum(0)
            state["moe_expert_tokens"] = tokens.tolist()
        return state

    @functools.cached_property
    def info(self) -> RunnerInfo:
        """Fixed once the runner is made: computed on first use (it reads generation_config.json)."""
        return RunnerInfo(
            max_total_tokens=self.max_total_tokens,
            num_pages=self.num_pages,
            kv_budget=self.kv_budget.describe(),
            page_size=self.config.page_size,
            context_length=self.context_length,
            long_rope_original=None if self.long_rope is None else self.long_rope.original,
            weight_bytes=self.weight_bytes,
            vocab_size=self.vocab_size,
            hidden_size=int(self.hf_config.hidden_size),
            cross_encoder=hasattr(self.model, "pool"),
            max_running_requests=self.max_running_requests,
            eos_token_ids=sorted(eos_token_ids(self.config.model_dir, self.hf_config)),
            batch_invariant=self.wing.batch_invariant(),
        )
