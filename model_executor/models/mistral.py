"""Mistral: the Llama block without biases (transformers ignores attention_bias and mlp_bias for it),
with sliding-window attention in every layer where sliding_window is set. srt attends to the whole
context, so a window narrower than the served context is refused (models/config_check.py)."""

from __future__ import annotations

from model_executor.models.config_check import ConfigFields
from model_executor.models.llama import LlamaForCausalLM
from model_executor.models.registry import register_model


@register_model("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    config_fields = ConfigFields(sliding_window="every_layer")
