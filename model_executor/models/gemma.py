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

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import PipelineStage, StageOutput
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.activation import GeluAndMul
from model_executor.layers.attention import Attention
from model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from model_executor.layers.vocab_parallel import VocabParallelEmbedding
from model_executor.models.config_check import GELU_ACTS, ConfigFields
from model_executor.models.llama import (
    LlamaForCausalLM,
    LlamaMLP,
    MissingLayer,
    head_dim_of,
    run_stage,
    sliding_window_of,
)
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
        qk_norm: bool,
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
        kernel = dtype == torch.bfloat16  # the norms on srt_rmsnorm_f32w on the default path
        self.q_norm = (
            GemmaRMSNorm(head_dim, config.rms_norm_eps, out_dtype=dtype, kernel=kernel) if qk_norm else None
        )
        self.k_norm = (
            GemmaRMSNorm(head_dim, config.rms_norm_eps, out_dtype=dtype, kernel=kernel) if qk_norm else None
        )
        softcap = getattr(config, "attn_logit_softcapping", None)
        self.rotary_emb = rotary_emb  # the layer kind's, shared with the other layers of that kind
        self.attn = Attention(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scaling=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=sliding_window,
            logit_softcap=float(softcap) if softcap is not None else None,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.heads(q, self.head_dim), self.k_norm.heads(k, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class GemmaMLP(LlamaMLP):
    """down(gelu(gate) * up): Llama's MLP with GELU (tanh-approximated as Gemma's checkpoints ask)."""

    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__(config, comm, dtype)
        self.act = GeluAndMul(GELU_ACTS[getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


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
        qk_norm: bool,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(
            config,
            layer_id,
            comm,
            dtype,
            rotary_emb=rotary_emb,
            sliding_window=sliding_window,
            qk_norm=qk_norm,
        )
        self.mlp = GemmaMLP(config, comm, dtype)
        kernel, f32 = dtype == torch.bfloat16, torch.float32  # post-norms hand float32 to the stream
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=dtype, kernel=kernel)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=f32, kernel=kernel)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=dtype, kernel=kernel)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, out_dtype=f32, kernel=kernel)

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


# (layer index in the stage, layer index, its rotary table, its window) -> the decoder layer
MakeLayer = Callable[[int, int, RotaryEmbedding, "int | None"], nn.Module]


class PostNormModel(nn.Module):
    """The model below the LM head of Gemma 3 and OLMo 2, whose layers norm each sublayer's output:
    embeddings (times `embed_scale`), the stage's layers from `make_layer` (each handed the rotary
    table of its kind in layer_types and its sliding window, `window_of`), `norm` on the last
    stage. A layer takes and returns the (hidden, residual) pair whose sum is the stream."""

    def __init__(
        self,
        config: Any,
        comm: Communicator,
        dtype: torch.dtype,
        stage: PipelineStage,
        *,
        make_layer: MakeLayer,
        norm: Callable[[], nn.Module],
        window_of: Callable[[int], int | None],
        embed_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm, params_dtype=dtype)
            if stage.is_first
            else None
        )
        self.embed_scale = embed_scale
        max_position = int(getattr(config, "max_position_embeddings", 4096))
        params = rope_parameters(config)
        kinds = layer_kinds(config)
        # one rotary table per layer kind (its own rope settings where rope_parameters has them)
        rotary = {
            kind: RotaryEmbedding(head_dim_of(config), max_position, dict(params.get(kind) or params), dtype)
            for kind in sorted(set(kinds))
        }
        self.rotary = nn.ModuleDict(rotary)
        self.layers = nn.ModuleList(
            make_layer(i - stage.start_layer, i, rotary[kinds[i]], window_of(i))
            if stage.owns_layer(i)
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.local_layers: list[nn.Module] = [m for m in self.layers if not isinstance(m, MissingLayer)]
        self.norm = norm() if stage.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        previous: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        for rotary in self.rotary.values():
            assert isinstance(rotary, RotaryEmbedding)
            rotary.forget_positions()
        return run_stage(self, input_ids, positions, batch, previous, self.embed_scale)


def full_attention_model(
    config: Any,
    comm: Communicator,
    dtype: torch.dtype,
    stage: PipelineStage,
    layer: Callable[[int, RotaryEmbedding], nn.Module],
) -> PostNormModel:
    """A PostNormModel whose layers attend to every key and whose final norm is a plain RMSNorm in
    the model's dtype (OLMo 2, GLM-4); `layer(layer_id, rotary)` makes the stage's layers."""
    return PostNormModel(
        config,
        comm,
        dtype,
        stage,
        make_layer=lambda layer_id, i, rotary, window: layer(layer_id, rotary),
        norm=lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=dtype),
        window_of=lambda layer_id: None,
    )


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True  # per-head (1 + w) norms of q and k
    config_fields = ConfigFields(
        attention_bias=True, sliding_window="layer_types", activation="gelu", rope_per_layer_type=True
    )

    def build_model(self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage) -> Any:
        return PostNormModel(
            config,
            comm,
            dtype,
            stage,
            make_layer=lambda layer_id, i, rotary, window: GemmaDecoderLayer(
                config, layer_id, comm, dtype, rotary_emb=rotary, sliding_window=window, qk_norm=self.qk_norm
            ),
            norm=lambda: GemmaRMSNorm(
                config.hidden_size, config.rms_norm_eps, out_dtype=dtype, kernel=dtype == torch.bfloat16
            ),
            window_of=lambda layer_id: sliding_window_of(self.config_fields, config, layer_id),
            embed_scale=float(config.hidden_size) ** 0.5,
        )

    def decoder_stack(self) -> None:
        return None  # the fused decode layer has no post-norms or GeGLU


@register_model("Gemma2ForCausalLM")
class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's block without the q/k norms, one rope setting for both layer kinds, and
    soft-capping of the attention scores (attn_logit_softcapping, in every layer) and of the final
    logits (final_logit_softcapping)."""

    qk_norm = False
    config_fields = ConfigFields(
        attention_bias=True, sliding_window="layer_types", activation="gelu", softcapping=True
    )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap
