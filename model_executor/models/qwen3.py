"""Qwen3: the Llama block with a per-head RMSNorm on q and k before rotary, biases on q/k/v/o where
attention_bias is set, sliding-window layers where layer_types marks them (refused where narrower
than the context: models/config_check.py)."""

from __future__ import annotations

from model_executor.models.config_check import ConfigFields
from model_executor.models.llama import LlamaForCausalLM
from model_executor.models.registry import register_model


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    config_fields = ConfigFields(attention_bias=True, sliding_window="layer_types")
