"""CpuDecodeRunner: decode steps as whole fused layers, beside ModelRunner (the CPU counterpart of
CUDA-graph replay: a step's shape of work prepared once, each layer one C call).

A decode batch on one rank (no tensor or pipeline parallelism), over a bf16 pool on the cpu_kernels
attention backend, of a model of plain Llama blocks (no q/k norm, no o_proj bias) runs each layer as
one srt_decode_layer call: any batch up to packed_max_rows() where the layers' weights are packed for
our kernels, else (srt_gemv, where it has its AVX-512 BF16 loop) a small one. ModelRunner asks
`can_run` first; every other batch runs the model's layers op by op.

Not in deterministic mode: there every step goes through the same layers as a prefill, the fused
layer's gemv arithmetic being its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention.base import AttentionBackend
from model_executor.attention.cpu_kernels_backend import CpuKernelsAttnBackend
from model_executor.forward_batch import ForwardBatch
from model_executor.kernels import cpu as cpu_kernels
from model_executor.kernels.cpu import GEMV_MAX_ROWS, Q4_MAX_ROWS, Int8Weight, Q4Weight, _p, kernels
from model_executor.layers.cpu_linear import PackedWeight, is_kernel_packed, packed_max_rows
from model_executor.models.base import CausalLM, DecoderStack, PreNormLayer


@dataclass
class DecodeLayerWeights:
    """What srt_decode_layer needs of one decoder layer that does not change between steps."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    packed: Sequence[torch.Tensor | Int8Weight | Q4Weight] | None  # qkv, o, gate_up, down packed by
    # bf16_pack, int8_pack or as Q4Weight, or None (gemv)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class DecodeLayers:
    """Every decoder layer of a decode step on one rank (TP=1), one srt_decode_layer call each.

    The weights, norms and KV buffers never move, so their pointers are gathered once here: per
    step only the batch's own arguments are converted (Python glue around 30 per-layer calls cost
    ~3 ms of a 38 ms batch-32 step on SmolLM2 before). With packed weights (`packed`) any number
    of rows, else at most GEMV_MAX_ROWS; Q4Weight layers on their Q4_1 weights up to Q4_MAX_ROWS
    rows, on the bf16 copies above. Every tensor contiguous bf16 / int64."""

    def __init__(self, layers: Sequence[DecodeLayerWeights]) -> None:
        self.layers = list(layers)  # keeps the tensors behind the pointers alive
        first = self.layers[0]
        self.packed = all(w.packed is not None for w in self.layers)
        self.hidden_size = first.w_o.shape[0]
        self.sizes = (first.w_qkv.shape[0], first.w_o.shape[1], first.w_down.shape[1])  # qkv, q, intermediate
        self.q4 = self.packed and all(isinstance(t, Q4Weight) for w in self.layers for t in w.packed or ())
        self._args = [self._layer_args(w, q4=False) for w in self.layers]
        self._args_q4 = [self._layer_args(w, q4=True) for w in self.layers] if self.q4 else self._args

    def _layer_args(self, w: DecodeLayerWeights, q4: bool) -> tuple[tuple, tuple, tuple]:
        def pointer(t: torch.Tensor | Int8Weight | Q4Weight | None) -> int | None:
            if isinstance(t, Q4Weight):
                return (t.packed if q4 else t.bf16).data_ptr()
            return None if t is None else t.packed.data_ptr() if isinstance(t, Int8Weight) else t.data_ptr()

        kernel_weights = w.packed if w.packed is not None else [None] * 4
        scales = [t.scale.data_ptr() if isinstance(t, Int8Weight) else None for t in kernel_weights]
        weights = (w.ln1.data_ptr(), w.ln2.data_ptr(), w.eps, w.w_qkv.data_ptr(), _p(w.b_qkv), w.w_o.data_ptr(),
                   w.w_gate_up.data_ptr(), w.w_down.data_ptr(), *map(pointer, kernel_weights), *scales, int(q4))
        dims = (self.hidden_size, w.num_heads, w.num_kv_heads, w.head_dim, w.w_down.shape[1], w.scale)
        return weights, (w.k_cache.data_ptr(), w.v_cache.data_ptr()), dims

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out_loc: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after every layer, as the op-by-op layers would return them."""
        lib = kernels()
        m = hidden.shape[0]
        assert lib is not None and (self.packed or m <= GEMV_MAX_ROWS) and hidden.is_contiguous()
        qkv_size, q_size, intermediate = self.sizes

        def buf(n: int) -> torch.Tensor:
            return torch.empty(m, n, dtype=torch.bfloat16)

        residual, out = buf(self.hidden_size), buf(self.hidden_size)
        scratch = [buf(qkv_size), buf(q_size), buf(self.hidden_size), buf(2 * intermediate), buf(intermediate), out]
        step = (positions.data_ptr(), cos.data_ptr(), sin.data_ptr())
        batch = (out_loc.data_ptr(), req_to_token.data_ptr(), req_to_token.stride(0), rows.data_ptr(),
                 seq_lens.data_ptr(), max_len, m)
        scratch_ptrs = [t.data_ptr() for t in scratch]
        hidden_ptr, residual_ptr = hidden.data_ptr(), residual.data_ptr()
        for i, (weights, kv, dims) in enumerate(self._args_q4 if m <= Q4_MAX_ROWS else self._args):
            lib.srt_decode_layer(hidden_ptr, residual_ptr, int(i == 0), *weights, *step, *kv, *batch, *dims,
                                 *scratch_ptrs)
            hidden_ptr = scratch_ptrs[-1]  # each layer's MLP output is the next layer's input
        return out, residual


def kernel_weights(layer: PreNormLayer) -> list[torch.Tensor | Int8Weight | Q4Weight] | None:
    """The layer's qkv, o, gate_up and down weights packed for our kernels (bf16, int8 or Q4_1),
    or None (a Q8_0 weight is only ever the LM head's)."""
    packed: list[PackedWeight | None] = [layer.qkv_proj.packed_weight, layer.o_proj.packed_weight,
                                         layer.gate_up_proj.packed_weight, layer.down_proj.packed_weight]
    kernel = [p for p in packed if p is not None and is_kernel_packed(p) and not isinstance(p, cpu_kernels.Q8Weight)]
    return kernel if len(kernel) == len(packed) else None


class CpuDecodeRunner:
    def __init__(self, model: CausalLM, attn_backend: AttentionBackend, *, tp_size: int, pp_size: int,
                 deterministic: bool) -> None:
        self.attn_backend = attn_backend
        self.stack: DecoderStack | None = None  # None: declines every batch
        self._layers: tuple[KVPool, DecodeLayers] | None = None
        stack = model.decoder_stack() if tp_size == 1 and pp_size == 1 else None
        if stack is None or deterministic or not isinstance(attn_backend, CpuKernelsAttnBackend) \
                or not attn_backend.kernel_attention:
            return
        first = stack.layers[0]
        # The embedding's output has the rotary tables' dtype and device: the kernels take both or neither.
        if first.q_norm is None and first.o_proj.bias is None and cpu_kernels.usable(stack.rotary_emb.cos):
            self.stack = stack

    def can_run(self, batch: ForwardBatch) -> bool:
        if self.stack is None or not batch.is_decode:
            return False
        packed = self.layers().packed
        return batch.batch_size <= (packed_max_rows() if packed else cpu_kernels.fused_gemv_max_batch())

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states [bs, hidden] of a batch can_run took, as the model's forward returns
        them; writes the step's K/V into the pool."""
        stack = self.stack
        assert stack is not None and isinstance(self.attn_backend, CpuKernelsAttnBackend)
        rotary = stack.rotary_emb
        hidden = stack.embed_tokens(batch.input_ids)
        hidden, residual = self.layers().forward(
            hidden, batch.positions, rotary.cos, rotary.sin, batch.out_cache_loc, self.attn_backend.req_to_token,
            batch.req_pool_indices, batch.seq_lens, max(batch.seq_lens_cpu))
        hidden, _ = stack.norm(hidden, residual)
        return hidden

    def layers(self) -> DecodeLayers:
        """The layers' kernel arguments, gathered on the first decode step (weights are packed by
        then) and again only if the KV pool is a different one."""
        stack = self.stack
        assert stack is not None and isinstance(self.attn_backend, CpuKernelsAttnBackend)
        kv_pool = self.attn_backend.kv_pool
        if self._layers is None or self._layers[0] is not kv_pool:
            self._layers = (kv_pool, DecodeLayers([decode_layer_weights(layer, kv_pool) for layer in stack.layers]))
        return self._layers[1]


def decode_layer_weights(layer: PreNormLayer, kv_pool: KVPool) -> DecodeLayerWeights:
    attn = layer.attn
    k_cache, v_cache = kv_pool.get_kv_buffer(attn.layer_id)
    return DecodeLayerWeights(
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
        layer.qkv_proj.weight, layer.qkv_proj.bias, layer.o_proj.weight, layer.gate_up_proj.weight,
        layer.down_proj.weight, kernel_weights(layer), k_cache, v_cache, attn.num_heads, attn.num_kv_heads,
        attn.head_dim, attn.scaling)
