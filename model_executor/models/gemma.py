"""Gemma 3 (text): the Llama block with Gemma's changes, as transformers' modeling_gemma3.py computes
them:

- RMSNorm as x / rms(x) * (1 + w) in float32 (layers/layernorm.py's GemmaRMSNorm), and four per
  layer: before and after attention, before and after the MLP (the "after" ones on the sublayer's
  output, before it joins the residual stream);
- q and k normalized per head the same way, before rotary;
- the MLP down(gelu_tanh(gate) * up) (GeGLU);
- embeddings scaled by sqrt(hidden_size);
- attention scaled by query_pre_attn_scalar ** -0.5;
- layer_types: "sliding_attention" layers attend within sliding_window and rotate with the local
  rope settings, "full_attention" layers over every key with the global ones (rope_parameters per
  layer type).

The residual stream is float32 as in models/llama.py; each sublayer's post-norm hands its float32
result to it unrounded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import PipelineStage, StageOutput
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention
from model_executor.layers.layernorm import GemmaRMSNorm
from model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from model_executor.layers.vocab_parallel import VocabParallelEmbedding
from model_executor.models.config_check import GELU_ACTS, ConfigFields
from model_executor.models.llama import LlamaForCausalLM, MissingLayer, head_dim_of
from model_executor.models.registry import register_model

LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_kinds(config: Any) -> list[str]:
    kinds = list(getattr(config, "layer_types", None) or [])
    return kinds if kinds else ["full_attention"] * int(config.num_hidden_layers)


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        comm: Communicator,
        dtype: torch.dtype,
        *,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias,
            comm,
            params_dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias,
            comm,
            params_dtype=dtype,
            what="number of attention heads x head_dim",
        )
        self.head_dim = head_dim
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, out_dtype=dtype)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, out_dtype=dtype)
        self.rotary_emb = rotary_emb  # the layer kind's, shared with the other layers of that kind
        self.attn = Attention(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scaling=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.q_norm.heads(q, self.head_dim), self.k_norm.heads(k, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], False, comm, params_dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, False, comm, params_dtype=dtype, what="intermediate size"
        )
        self.approximate = GELU_ACTS[getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        comm: Communicator,
        dtype: torch.dtype,
        *,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(
            config, layer_id, comm, dtype, rotary_emb=rotary_emb, sliding_window=sliding_window
        )
        self.mlp = GemmaMLP(config, comm, dtype)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=torch.float32)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=torch.float32)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden + residual is the layer's input (residual None: hidden is); returns the pair whose
        sum is its output."""
        if residual is None:
            residual = hidden.float()
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        attn = self.post_attention_layernorm(self.self_attn(positions, x, batch))
        x, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage) -> None:
        super().__init__()
        self.stage = stage
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm, params_dtype=dtype)
            if stage.is_first
            else None
        )
        self.embed_scale = float(config.hidden_size) ** 0.5
        max_position = int(getattr(config, "max_position_embeddings", 4096))
        params = rope_parameters(config)
        kinds = layer_kinds(config)
        # one rotary table per layer kind (its own rope settings where rope_parameters has them)
        rotary = {
            kind: RotaryEmbedding(head_dim_of(config), max_position, dict(params.get(kind) or params), dtype)
            for kind in sorted(set(kinds))
        }
        self.rotary = nn.ModuleDict(rotary)
        window = getattr(config, "sliding_window", None)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config,
                i - stage.start_layer,
                comm,
                dtype,
                rotary_emb=rotary[kinds[i]],
                sliding_window=int(window) if kinds[i] == "sliding_attention" and window else None,
            )
            if stage.owns_layer(i)
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.local_layers: list[GemmaDecoderLayer] = [
            m for m in self.layers if isinstance(m, GemmaDecoderLayer)
        ]
        self.norm = (
            GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, out_dtype=dtype) if stage.is_last else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        previous: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        residual: torch.Tensor | None = None
        for rotary in self.rotary.values():
            assert isinstance(rotary, RotaryEmbedding)
            rotary.forget_positions()
        if previous is None:
            assert self.embed_tokens is not None, "only the first pipeline stage embeds the input ids"
            hidden = self.embed_tokens(input_ids).float() * self.embed_scale
        else:
            hidden, residual = previous.hidden, previous.residual
        for layer in self.local_layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        if self.norm is None:
            assert residual is not None
            return StageOutput(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(LlamaForCausalLM):
    config_fields = ConfigFields(
        attention_bias=True, sliding_window="layer_types", activation="gelu", rope_per_layer_type=True
    )

    def build_model(self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage) -> Any:
        return GemmaModel(config, comm, dtype, stage)

    def decoder_stack(self) -> None:
        return None  # the fused decode layer has no post-norms or GeGLU
