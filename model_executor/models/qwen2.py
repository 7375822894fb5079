"""Qwen2: the Llama block with a bias on q/k/v."""

from __future__ import annotations

from model_executor.models.llama import LlamaForCausalLM
from model_executor.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
