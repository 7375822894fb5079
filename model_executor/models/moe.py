"""Mixture-of-experts models: the Llama block with a sparse MLP (layers/moe.py) in place of the dense
one, in every layer or where the config says.

| architecture | attention | experts | a layer is sparse | top-k weights renormalized |
|---|---|---|---|---|
| Qwen3MoeForCausalLM | Qwen3's (per-head q/k norm) | moe_intermediate_size | decoder_sparse_step, mlp_only_layers | norm_topk_prob |
| Qwen2MoeForCausalLM | Qwen2's (q/k/v bias where qkv_bias) | same, and a gated shared expert | same | norm_topk_prob |
| MixtralForCausalLM | Mistral's | intermediate_size (w1, w3, w2) | every layer | always |
| OlmoeForCausalLM | Llama's, one q and one k norm across heads | intermediate_size | every layer | norm_topk_prob |
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.layers.moe import SparseMoeBlock
from model_executor.models.config_check import ConfigFields
from model_executor.models.llama import AttentionSwitches, LlamaForCausalLM, LlamaMLP
from model_executor.models.registry import register_model


class MoeCausalLM(LlamaForCausalLM):
    experts_field = "num_experts"  # config.json's number of experts
    expert_size_field = "moe_intermediate_size"  # an expert's intermediate size
    sparse_step = True  # decoder_sparse_step and mlp_only_layers say which layers are sparse
    always_renormalize = False  # else norm_topk_prob says
    shared_expert = False

    def make_mlp(self, config: Any, layer_id: int, comm: Communicator, dtype: torch.dtype) -> nn.Module:
        num_experts = int(getattr(config, self.experts_field))
        if self.sparse_step:
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense = layer_id in (getattr(config, "mlp_only_layers", None) or []) or (layer_id + 1) % step != 0
            if dense or num_experts == 0:
                return LlamaMLP(config, comm, dtype)
        return SparseMoeBlock(
            hidden_size=config.hidden_size,
            intermediate_size=int(getattr(config, self.expert_size_field)),
            num_experts=num_experts,
            top_k=int(config.num_experts_per_tok),
            renormalize=self.always_renormalize or bool(getattr(config, "norm_topk_prob", False)),
            comm=comm,
            dtype=dtype,
            layer_id=layer_id,
            shared_intermediate_size=(
                int(config.shared_expert_intermediate_size) if self.shared_expert else None
            ),
        )


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MoeCausalLM):
    qk_norm = True
    config_fields = ConfigFields(attention_bias=True, sliding_window="every_layer")


@register_model("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(MoeCausalLM):
    shared_expert = True
    config_fields = ConfigFields(sliding_window="layer_types")

    def attention_switches(self, config: Any) -> AttentionSwitches:
        return AttentionSwitches(bool(getattr(config, "qkv_bias", True)), False, False)


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(MoeCausalLM):
    experts_field = "num_local_experts"
    expert_size_field = "intermediate_size"
    sparse_step = False
    always_renormalize = True
    config_fields = ConfigFields(sliding_window="every_layer")
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }

    def rename_checkpoint_tensor(self, name: str) -> str:
        return super().rename_checkpoint_tensor(name.replace(".block_sparse_moe.", ".mlp."))


@register_model("OlmoeForCausalLM")
class OlmoeForCausalLM(MoeCausalLM):
    expert_size_field = "intermediate_size"
    sparse_step = False
    qk_norm_across_heads = True
    config_fields = ConfigFields(attention_bias=True, clip_qkv=True)
