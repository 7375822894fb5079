"""GLM-4 (Glm4ForCausalLM: GLM-4-0414, GLM-Z1), as transformers' modeling_glm4.py computes it: the Llama
attention with biases on q, k and v (none on o) and the Llama MLP, whose checkpoint stores gate and
up as one `gate_up_proj` (split into its parts at load, models/phi3.py split_rows, so tensor
parallelism shards them as any Llama's); sandwich norms: each sublayer's input is normed
(input_layernorm, post_attention_layernorm) and so is its output (post_self_attn_layernorm,
post_mlp_layernorm) before it joins the residual stream. Rotary on the first half of each head
(partial_rotary_factor 0.5) in interleaved pairs (0, 1), (2, 3), ...: q's and k's rows reordered at
load into srt's rotate-half layout (layers/rotary.py rope_permutation). The post-norms keep float32
weights and hand their float32 result to the stream unrounded, as OLMo 2's (models/olmo2.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import PipelineStage
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.layernorm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.loader.load_weights import NamedTensorSource
from model_executor.models.config_check import ConfigFields
from model_executor.models.gemma import full_attention_model
from model_executor.models.llama import AttentionSwitches, LlamaAttention, LlamaForCausalLM, LlamaMLP
from model_executor.models.phi3 import FusedParts, split_rows
from model_executor.models.registry import register_model


class Glm4DecoderLayer(nn.Module):
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
        self.self_attn = LlamaAttention(
            config, layer_id, comm, dtype, switches=switches, rotary_emb=rotary_emb
        )
        self.mlp = LlamaMLP(config, comm, dtype)
        size, eps, f32 = config.hidden_size, config.rms_norm_eps, torch.float32
        self.input_layernorm = RMSNorm(size, eps, params_dtype=dtype)
        self.post_self_attn_layernorm = RMSNorm(size, eps, params_dtype=f32)
        self.post_attention_layernorm = RMSNorm(size, eps, params_dtype=dtype)  # the MLP's input
        self.post_mlp_layernorm = RMSNorm(size, eps, params_dtype=f32)

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
            x, residual = self.input_layernorm.start(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        attn = self.post_self_attn_layernorm(self.self_attn(positions, x, batch))
        x, residual = self.post_attention_layernorm(attn, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


@register_model("Glm4ForCausalLM")
class Glm4ForCausalLM(LlamaForCausalLM):
    rope_interleaved = True
    config_fields = ConfigFields(attention_bias=True, partial_rotary=True)

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        inter = config.intermediate_size
        self._parts: FusedParts = {"gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, inter))}

    def attention_switches(self, config: Any) -> AttentionSwitches:
        bias = bool(getattr(config, "attention_bias", False))  # q, k and v; o_proj has none
        return AttentionSwitches(qkv_bias=bias, o_bias=False, qk_norm=False)

    def build_model(self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage) -> Any:
        switches = self.attention_switches(config)
        return full_attention_model(
            config,
            comm,
            dtype,
            stage,
            lambda layer_id, rotary: Glm4DecoderLayer(
                config, layer_id, comm, dtype, switches=switches, rotary_emb=rotary
            ),
        )

    def split_fused(self, tensor: NamedTensorSource) -> list[NamedTensorSource]:
        return split_rows(tensor, self._parts)

    def decoder_stack(self) -> None:
        return None  # the fused decode layer has no post-norms
