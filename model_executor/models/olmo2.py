"""OLMo 2 (Olmo2ForCausalLM): the Llama attention and MLP with no norm before either; each sublayer's
output is normed (post_attention_layernorm, post_feedforward_layernorm) before it joins the residual
stream, and q and k are RMS-normed across all their heads (as OLMoE's, their sums of squares
all-reduced at TP>1), as transformers' modeling_olmo2.py computes them. The post-norms keep float32
weights and hand their float32 result to the stream unrounded."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import PipelineStage
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.layernorm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.models.config_check import ConfigFields
from model_executor.models.gemma import full_attention_model
from model_executor.models.llama import AttentionSwitches, LlamaAttention, LlamaForCausalLM, LlamaMLP
from model_executor.models.registry import register_model


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        comm: Communicator,
        dtype: torch.dtype,
        *,
        switches: AttentionSwitches,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.self_attn = LlamaAttention(
            config, layer_id, comm, dtype, switches=switches, rotary_emb=rotary_emb
        )
        self.mlp = LlamaMLP(config, comm, dtype)
        eps = config.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, params_dtype=torch.float32)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, params_dtype=torch.float32)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden.float() if residual is None else residual + hidden
        attn = self.post_attention_layernorm(self.self_attn(positions, residual.to(self.dtype), batch))
        residual = residual + attn
        return self.post_feedforward_layernorm(self.mlp(residual.to(self.dtype))), residual


@register_model("Olmo2ForCausalLM")
class Olmo2ForCausalLM(LlamaForCausalLM):
    qk_norm_across_heads = True
    config_fields = ConfigFields(attention_bias=True)

    def build_model(self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage) -> Any:
        switches = self.attention_switches(config)
        return full_attention_model(
            config,
            comm,
            dtype,
            stage,
            lambda layer_id, rotary: Olmo2DecoderLayer(
                config, layer_id, comm, dtype, switches=switches, rotary_emb=rotary
            ),
        )

    def decoder_stack(self) -> None:
        return None  # the fused decode layer has no post-norms
