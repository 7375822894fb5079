"""CpuEncoderRunner: an encoder's (BERT's) layers as one C call each (srt_bert_layer), beside
ModelRunner, for `--is-embedding` on one rank (no tensor or pipeline parallelism).

A layer's modules make about a dozen calls into our kernels (the four linears, the attention, two
LayerNorms, the GELU) with Python, ctypes and tensor allocations between them, which at a short
text cost about as much as the arithmetic. srt_bert_layer makes the same calls, in the same order,
on the same values, so a batch it takes gets the same bits as the modules give it; it takes any
batch of whole prompts up to packed_max_rows() tokens where each layer's four linears are packed
for srt_bf16_linear. Every other batch runs the model's layers op by op.

With a thread governor (cpu/thread_governor.py) a batch it runs gets the governed thread count: our
kernels' bits do not depend on it.
"""

from __future__ import annotations

import torch

from model_executor.cpu.kernels import ops
from model_executor.cpu.linear import is_kernel_packed, packed_max_rows, packed_of
from model_executor.cpu.thread_governor import ThreadGovernor
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.linear import LinearBase
from model_executor.models.base import CausalLM
from model_executor.models.bert import BertLayer, BertModel
from model_executor.step_runner import StepRunner


def layer_params(layer: BertLayer) -> tuple[list[torch.Tensor], float] | None:
    """srt_bert_layer's parameters of the layer, in its order, and the LayerNorms' eps; None where it
    cannot run the layer (a linear not packed for srt_bf16_linear, a bias missing or not bf16, the two
    LayerNorms of different eps)."""
    linears: tuple[LinearBase, ...] = (
        layer.attention.self.qkv_proj,
        layer.attention.output.dense,
        layer.intermediate.dense,
        layer.output.dense,
    )
    packed = [packed_of(linear.linear_method) for linear in linears]
    biases = [linear.bias for linear in linears]
    norms = (layer.attention.output.LayerNorm, layer.output.LayerNorm)
    if not all(isinstance(p, torch.Tensor) and is_kernel_packed(p) for p in packed):
        return None
    if not all(b is not None and b.dtype == torch.bfloat16 for b in biases) or norms[0].eps != norms[1].eps:
        return None
    (qkv, o, inter, out), (qkv_b, o_b, inter_b, out_b) = packed, biases
    params = [qkv, qkv_b, o, o_b, norms[0].weight, norms[0].bias, inter, inter_b, out, out_b, norms[1].weight]
    return [*params, norms[1].bias], norms[0].eps  # type: ignore[list-item]


class CpuEncoderRunner(StepRunner):
    def __init__(
        self, model: CausalLM, *, tp_size: int, pp_size: int, thread_governor: ThreadGovernor | None = None
    ) -> None:
        self.thread_governor = thread_governor
        one_rank = tp_size == 1 and pp_size == 1
        self.model: BertModel | None = model if isinstance(model, BertModel) and one_rank else None
        self.layers: list[tuple[torch.Tensor, float]] = []  # per layer: its parameters' addresses, eps

    def prepare(self) -> None:
        """The layers' parameter addresses (the weights are packed by now); declines every batch where
        a layer cannot run fused or the model is not bf16 on our kernels."""
        model = self.model
        if model is None or not ops.computes(
            model.embeddings.position_embeddings.weight.dtype, torch.device("cpu")
        ):
            self.model = None
            return
        for layer in model.encoder.layer:
            assert isinstance(layer, BertLayer)
            found = layer_params(layer)
            if found is None:
                self.model, self.layers = None, []
                return
            params, eps = found
            self.layers.append((torch.tensor([p.data_ptr() for p in params], dtype=torch.int64), eps))

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            self.model is not None
            and batch.num_tokens <= packed_max_rows()
            and not any(batch.extend_prefix_lens_cpu)
        )

    def begin_step(self, batch: ForwardBatch, runs: bool) -> None:
        if self.thread_governor is not None:
            self.thread_governor.apply(governed=runs)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states [tokens, hidden] (float32), as BertModel.forward returns them."""
        model = self.model
        assert model is not None and self.can_run(batch), "a batch CpuEncoderRunner declined"
        lens = batch.extend_seq_lens_cpu
        types = model.token_types(batch.input_ids, lens)
        h, hb = (t.contiguous() for t in model.embeddings(batch.input_ids, batch.positions, types))
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        scratch = ops.bert_layer_scratch(len(h), config.hidden_size, config.intermediate_size)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        for params, eps in self.layers:
            ops.bert_layer(h, hb, lens_t, params, eps, head_dim, config.intermediate_size, scratch)
        return h
