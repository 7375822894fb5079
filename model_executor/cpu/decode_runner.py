"""CpuDecodeRunner: decode steps as whole fused layers, beside ModelRunner (the CPU counterpart of
CUDA-graph replay: a step's shape of work prepared once, each layer one C call).

A decode batch on one rank (no tensor or pipeline parallelism), over a bf16 pool on the cpu_kernels
attention backend, of a model of Llama blocks (no o_proj bias; q/k norms per head, as Qwen3's, or
none; a dense MLP or a mixture of experts srt_moe_block runs) runs each layer as one
srt_decode_layer call: any batch up to packed_max_rows() where the layers' weights are packed for
our kernels, else (srt_gemv, where it has its AVX-512 BF16 loop) a small one. It is the CPU wing's
StepRunner: ModelRunner asks `can_run` first; every other batch runs the model's layers op by op.

Not in deterministic mode: there every step goes through the same layers as a prefill, the fused
layer's gemv arithmetic being its own.

With a thread governor (cpu/thread_governor.py) it also sets each step's threads (`begin_step`): the
governed count for the steps that run wholly in our kernels, whose bits do not depend on it, the
configured count for every other step.
"""

from __future__ import annotations

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention.base import AttentionBackend
from model_executor.cpu.attention_backend import CpuKernelsAttnBackend
from model_executor.cpu.kernels import build, ops
from model_executor.cpu.kernels.decode_layers import DecodeLayers, DecodeLayerWeights, KernelWeight
from model_executor.cpu.kernels.packing import GgufWeight, Int8Weight, SplitWeight
from model_executor.cpu.linear import PackedWeight, is_kernel_packed, packed_max_rows, packed_of
from model_executor.cpu.moe import FusedExperts
from model_executor.cpu.thread_governor import ThreadGovernor
from model_executor.forward_batch import ForwardBatch
from model_executor.lora.linear_method import LoraLinearMethod
from model_executor.models.base import CausalLM, DecoderStack, PreNormLayer
from model_executor.step_runner import StepRunner


def kernel_weights(layer: PreNormLayer) -> list[KernelWeight | None] | None:
    """The layer's qkv, o, gate_up and down weights packed for our kernels (bf16, int8, or a GGUF
    weight's blocks; with a mixture of experts qkv and o, then None twice), or
    None."""
    mlp = (layer.gate_up_proj, layer.down_proj) if layer.moe is None else ()
    packed: list[PackedWeight | None] = [
        packed_of(linear.linear_method)
        for linear in (layer.qkv_proj, layer.o_proj, *mlp)
        if linear is not None
    ]
    kernel = [
        p
        for p in packed
        if (isinstance(p, torch.Tensor | Int8Weight | GgufWeight) and is_kernel_packed(p))
        or (p is packed[0] and split_at_v(p, layer))
    ]
    if len(kernel) != len(packed) or len(packed) != 2 + len(mlp):
        return None
    return [*kernel, None, None] if layer.moe is not None else list(kernel)


def split_at_v(packed: PackedWeight | None, layer: PreNormLayer) -> bool:
    """Whether a qkv weight is split on two kinds of blocks (packing.SplitWeight) with v's rows the
    second part, as srt_decode_layer takes it."""
    q_size = getattr(layer.qkv_proj, "q_size", 0)
    kv_size = getattr(layer.qkv_proj, "kv_size", 0)
    return isinstance(packed, SplitWeight) and packed.rows == (q_size + kv_size, kv_size)


def fused_moe(layer: PreNormLayer) -> FusedExperts | None:
    """A MoE layer's srt_moe_block form (cpu/moe.py), where its weights are packed bf16."""
    method = layer.moe.experts_method if layer.moe is not None else None
    return method if isinstance(method, FusedExperts) else None


def fusable(layer: PreNormLayer) -> bool:
    """Whether srt_decode_layer computes the layer: a dense MLP, or experts srt_moe_block runs (with
    every weight packed for our kernels); q/k norms per head with the layer's eps or none."""
    if layer.moe is not None and (fused_moe(layer) is None or kernel_weights(layer) is None):
        return False
    if layer.o_proj.bias is not None or (layer.q_norm is None) != (layer.k_norm is None):
        return False
    return layer.q_norm is None or layer.q_norm.eps == layer.k_norm.eps == layer.input_layernorm.eps  # type: ignore[union-attr]


class CpuDecodeRunner(StepRunner):
    takes_lora = True  # srt_decode_layer adds the adapters' deltas (cpu_lora.c) where their tables say

    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        *,
        tp_size: int,
        pp_size: int,
        deterministic: bool,
        thread_governor: ThreadGovernor | None = None,
    ) -> None:
        self.attn_backend = attn_backend
        self.thread_governor = thread_governor
        self.stack: DecoderStack | None = None  # None: declines every batch
        self._layers: tuple[KVPool, DecodeLayers] | None = None
        stack = model.decoder_stack() if tp_size == 1 and pp_size == 1 else None
        if (
            stack is None
            or deterministic
            or not isinstance(attn_backend, CpuKernelsAttnBackend)
            or not attn_backend.kernel_attention
        ):
            return
        # The embedding's output has the rotary tables' dtype and device: the kernels take both or neither.
        if all(map(fusable, stack.layers)) and ops.usable(stack.rotary_emb.cos):
            self.stack = stack

    def prepare(self) -> None:
        """Gathers the fused layers' kernel arguments (the weights are packed by now)."""
        if self.stack is not None:
            self.layers()

    def can_run(self, batch: ForwardBatch) -> bool:
        if self.stack is None or not batch.is_decode:
            return False
        layers = self.layers()
        if not layers.lora_tables_taken():
            return False
        return batch.batch_size <= (packed_max_rows() if layers.packed else ops.fused_gemv_max_batch())

    def prefill_in_kernels(self, batch: ForwardBatch) -> bool:
        """Whether a prefill runs wholly in our kernels, which share out whole outputs between
        threads, so that its bits do not depend on the thread count: at most packed_max_rows() tokens
        over packed layers where the prefill attention kernel applies (a longer one goes to oneDNN's
        GEMM, whose bits move with the threads). With the batches `can_run` takes, these are the
        steps the thread governor changes threads for."""
        if self.stack is None or batch.is_decode or batch.num_tokens > packed_max_rows():
            return False
        attn = self.stack.layers[0].attn
        return (
            self.layers().packed
            and attn.head_dim in (64, 128)
            and attn.num_heads % attn.num_kv_heads == 0
            and build.prefill_kernel_available()
        )

    def begin_step(self, batch: ForwardBatch, runs: bool) -> None:
        """With a thread governor: the governed threads for a step that runs wholly in our kernels
        (one `run` takes, or prefill_in_kernels), the configured ones for every other step."""
        if self.thread_governor is not None:  # only our kernels' bits are the same at any thread count
            self.thread_governor.apply(governed=runs or self.prefill_in_kernels(batch))

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states [bs, hidden] of a batch can_run took, as the model's forward returns
        them; writes the step's K/V into the pool."""
        stack = self.stack
        assert stack is not None and isinstance(self.attn_backend, CpuKernelsAttnBackend)
        rotary = stack.rotary_emb
        hidden = stack.embed_tokens(batch.input_ids)
        hidden, residual = self.layers().forward(
            hidden,
            batch.positions,
            rotary.cos,
            rotary.sin,
            batch.out_cache_loc,
            self.attn_backend.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            max(batch.seq_lens_cpu),
            None
            if batch.window_cache_loc is None
            else (batch.window_cache_loc, self.attn_backend.window_req_to_token),  # type: ignore[arg-type]
        )
        hidden, _ = stack.norm(hidden, residual)
        return hidden

    def layers(self) -> DecodeLayers:
        """The layers' kernel arguments, gathered by `prepare` (or on first use) and again only if
        the KV pool is a different one."""
        stack = self.stack
        assert stack is not None and isinstance(self.attn_backend, CpuKernelsAttnBackend)
        kv_pool = self.attn_backend.kv_pool
        if self._layers is None or self._layers[0] is not kv_pool:
            self._layers = (
                kv_pool,
                DecodeLayers([decode_layer_weights(layer, kv_pool) for layer in stack.layers]),
            )
        return self._layers[1]


def decode_layer_weights(layer: PreNormLayer, kv_pool: KVPool) -> DecodeLayerWeights:
    attn, moe = layer.attn, fused_moe(layer)
    k_cache, v_cache = kv_pool.get_kv_buffer(attn.layer_id)

    def on_route(ids: torch.Tensor) -> None:  # as SparseMoeBlock.forward calls its route_hook
        block = layer.moe
        if block is not None and block.route_hook is not None:
            block.route_hook(block.layer_id, ids)

    return DecodeLayerWeights(
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        layer.input_layernorm.eps,
        layer.qkv_proj.weight,
        layer.qkv_proj.bias,
        layer.o_proj.weight,
        None if layer.gate_up_proj is None else layer.gate_up_proj.weight,
        None if layer.down_proj is None else layer.down_proj.weight,
        kernel_weights(layer),
        k_cache,
        v_cache,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.scaling,
        None if layer.q_norm is None else layer.q_norm.weight,
        None if layer.k_norm is None else layer.k_norm.weight,
        None if moe is None else moe.descriptor,
        0 if layer.moe is None else layer.moe.top_k,
        on_route if layer.moe is not None else None,
        attn.sliding_window,
        attn.layer_id in kv_pool.window_layers,
        lora_methods(layer),
    )


def lora_methods(layer: PreNormLayer) -> list[LoraLinearMethod | None] | None:
    """With LoRA on, the layer's qkv, o, gate_up and down methods (None for a mixture's MLP)."""
    linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    methods = [None if linear is None else linear.linear_method for linear in linears]
    if not isinstance(methods[0], LoraLinearMethod):
        return None
    return [m if isinstance(m, LoraLinearMethod) else None for m in methods]
