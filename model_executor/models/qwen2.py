"""Qwen2: the Llama block with a bias on q/k/v (whatever attention_bias says), sliding-window layers
where layer_types marks them (refused where narrower than the context: models/config_check.py)."""

from __future__ import annotations

from model_executor.models.config_check import ConfigFields
from model_executor.models.llama import LlamaForCausalLM
from model_executor.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    config_fields = ConfigFields(sliding_window="layer_types")
