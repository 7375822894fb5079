"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama block whose checkpoint stores q, k and v as one
`qkv_proj` tensor and gate and up as one `gate_up_proj`; split back into the parts srt's packed
layers load, so tensor parallelism shards them as any Llama's. A sliding window in every layer where
sliding_window is set (Phi-3-mini-4k: 2047). LongRoPE (the 128k models) on its short and long factors,
chosen per request and position (layers/rotary.py LongRope); a partial rotary factor
(Phi-4-mini's 0.75: the first 3/4 of each head rotate, rotate-half) with q's and k's rows reordered at
load (layers/rotary.py rope_permutation)."""

from __future__ import annotations

from typing import Any

from model_executor.loader.load_weights import NamedTensorSource, RowSlice
from model_executor.models.config_check import ConfigFields
from model_executor.models.llama import LlamaForCausalLM, head_dim_of
from model_executor.models.registry import register_model

FusedParts = dict[str, tuple[tuple[str, int, int], ...]]


def split_rows(tensor: NamedTensorSource, parts: FusedParts) -> list[NamedTensorSource]:
    """A fused checkpoint tensor (its name's last module part a key of `parts`) as its parts' rows,
    under their names; another tensor as it is."""
    prefix, _, leaf = tensor.name.rpartition(".")  # model.layers.0.self_attn.qkv_proj, weight
    head, _, fused = prefix.rpartition(".")
    if fused not in parts:
        return [tensor]
    return [RowSlice(f"{head}.{name}.{leaf}", tensor, start, rows) for name, start, rows in parts[fused]]


@register_model("Phi3ForCausalLM")
class Phi3ForCausalLM(LlamaForCausalLM):
    config_fields = ConfigFields(sliding_window="every_layer", partial_rotary=True)

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        head_dim = head_dim_of(config)
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        inter = config.intermediate_size
        # fused checkpoint tensor -> its parts' (name, first row, rows), in the fused rows' order
        self._parts: FusedParts = {
            "qkv_proj": (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)),
            "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, inter)),
        }

    def split_fused(self, tensor: NamedTensorSource) -> list[NamedTensorSource]:
        return split_rows(tensor, self._parts)
