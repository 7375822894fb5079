"""Qwen3: the Llama block with a per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from model_executor.models.llama import LlamaForCausalLM
from model_executor.models.registry import register_model


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
