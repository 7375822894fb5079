"""The config.json fields that change a model's math, and the start-up check that refuses a value srt
does not implement, naming the field, instead of serving a different model than the one trained.

Decided from transformers 5's modeling_{llama,mistral,qwen2,qwen3,qwen2_moe,qwen3_moe,mixtral,olmoe,gemma2,gemma3,phi3,olmo2,glm4}.py. Each model class declares in
`config_fields` which architecture-specific fields its transformers code reads; the rest of the
table holds for every registered architecture.

| field (config.json) | transformers reads it in | srt |
|---|---|---|
| hidden_act | all but Gemma: down(act(gate) * up) | "silu" and "swish" (both SiLU); others refused |
| hidden_activation | Gemma 2, Gemma 3: down(act(gate) * up) | "gelu_pytorch_tanh" and "gelu"; others refused |
| rope_type (rope_parameters / rope_scaling) | all | default, linear, llama3, longrope (short and long factors and the attention factor: long for a prompt past original_max_position_embeddings, and for any position from it on) (layers/rotary.py); dynamic, yarn, ... refused |
| partial_rotary_factor | Phi-3, GLM-4: only the first int(head_dim * factor) dims of each head rotate; elsewhere linear, llama3 rope (below 1 the shapes break), default rope ignores it | implemented for Phi-3 and GLM-4 (layers/rotary.py: q and k rows reordered at load, whole-head tables with frequency 0 on the rest), where both parts of a head are even; refused unless 1 elsewhere |
| rope_parameters per layer type | Gemma 3: its local and global layers' settings | implemented for Gemma 3 (each checked as above); refused elsewhere |
| query_pre_attn_scalar | Gemma 3: attention scaled by its -1/2 power | implemented |
| use_bidirectional_attention | Gemma 3: attention to later tokens too | refused when true |
| attention_bias | Llama, Qwen3: biases on q, k, v and o | implemented (Qwen2: q, k, v always; Mistral: never) |
| mlp_bias | Llama: biases on gate, up and down | refused when true |
| sliding_window | Mistral, Phi-3: every layer, when not null (Llama: not read) | implemented (Attention.sliding_window) |
| layer_types (where config.json has none: from use_sliding_window, sliding_window, max_window_layers) | Qwen2, Qwen3, Gemma 2, Gemma 3 | "sliding_attention" layers attend within sliding_window; other kinds refused |
| attn_logit_softcapping, final_logit_softcapping | Gemma 2 (sets both), Gemma 3 (null in its checkpoints) | implemented for Gemma 2; refused when set elsewhere: a checkpoint that sets one was trained with it |
| head_dim | all | implemented |
| num_experts / num_local_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob | the MoE models | implemented (models/moe.py) |
| decoder_sparse_step, mlp_only_layers | Qwen2-MoE, Qwen3-MoE: which layers are sparse | implemented |
| shared_expert_intermediate_size | Qwen2-MoE: the gated shared expert | implemented |
| qkv_bias | Qwen2-MoE: biases on q, k, v | implemented |
| clip_qkv | OLMoE: q, k and v clamped to +-clip_qkv | refused when set |
| router_aux_loss_coef, output_router_logits, router_jitter_noise | training only (the load-balancing loss, jitter while training) | ignored |
| attention_dropout | training only | ignored |
| pretraining_tp | none of them (transformers 4 split the matmuls, same math) | ignored |

A sliding window of w tokens lets position q attend to keys q-w+1 .. q (transformers' sliding mask).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from model_executor.layers.rotary import ROPE_TYPES, rope_parameters, rotary_dim

SILU_ACTS = ("silu", "swish")  # transformers' ACT2FN makes both SiLU; srt's MLP is silu(gate) * up
# transformers' ACT2FN name -> torch's F.gelu approximate= for it
GELU_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ConfigFields:
    """Which architecture-specific config.json fields an architecture's transformers code reads."""

    attention_bias: bool = False  # biases on q, k, v and o where attention_bias is true
    mlp_bias: bool = False  # biases on gate, up and down where mlp_bias is true
    # "every_layer": every layer attends within sliding_window where it is not null (Mistral);
    # "layer_types": the layers layer_types marks "sliding_attention" do (Qwen2, Qwen3)
    sliding_window: Literal["ignored", "every_layer", "layer_types"] = "ignored"
    clip_qkv: bool = False  # q, k and v clamped where clip_qkv is set (OLMoE)
    # "silu": down(silu(gate) * up) whatever hidden_act names, refused unless SiLU; "gelu": Gemma's
    # down(gelu(gate) * up), with the GELU hidden_activation names (GELU_ACTS)
    activation: Literal["silu", "gelu"] = "silu"
    rope_per_layer_type: bool = False  # rope_parameters keyed by layer type (Gemma 3: local and global)
    softcapping: bool = False  # attn_logit_softcapping and final_logit_softcapping (Gemma 2)
    partial_rotary: bool = False  # partial_rotary_factor: the first part of each head rotates (Phi-3, GLM-4)


@dataclass(frozen=True)
class Refusal:
    field: str
    value: Any
    what: str  # the math the value asks for
    remedy: str = ""


def check_config(architecture: str, fields: ConfigFields, config: Any, context_length: int) -> None:
    """Raises ValueError naming every field of `config` (a transformers config) whose value asks for
    math srt does not implement for `architecture`, served with `context_length` tokens."""
    refusals = [
        *_activation(fields, config),
        *_rope(fields, config),
        *_bidirectional(config),
        *_biases(fields, config),
        *_clip_qkv(fields, config),
        *_sliding_window(fields, config),
        *([] if fields.softcapping else _softcapping(config)),
    ]
    if refusals:
        listed = ", ".join(f"{r.field}={json.dumps(r.value)} ({r.what})" for r in refusals)
        verb = "is" if len(refusals) == 1 else "are"
        remedies = "".join(f"; {r.remedy}" for r in refusals if r.remedy)
        raise ValueError(f"config.json: {listed} {verb} not implemented by srt for {architecture}{remedies}")


def _activation(fields: ConfigFields, config: Any) -> list[Refusal]:
    if fields.activation == "gelu":
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act in GELU_ACTS:
            return []
        return [
            Refusal(
                "hidden_activation",
                act,
                f"the MLP's activation; srt computes gelu(gate) * up with {', '.join(GELU_ACTS)}",
            )
        ]
    act = getattr(config, "hidden_act", "silu")
    if act in SILU_ACTS:
        return []
    return [Refusal("hidden_act", act, "the MLP's activation; srt computes silu(gate) * up")]


def _bidirectional(config: Any) -> list[Refusal]:
    if getattr(config, "use_bidirectional_attention", False):
        return [Refusal("use_bidirectional_attention", True, "attention to later tokens (an encoder)")]
    return []


def _rope(fields: ConfigFields, config: Any) -> list[Refusal]:
    params = rope_parameters(config)
    per_layer_type = sorted(key for key, value in params.items() if isinstance(value, dict))
    if per_layer_type and not fields.rope_per_layer_type:
        return [Refusal("rope_parameters", per_layer_type, "a rope setting per layer type")]
    if per_layer_type:
        return [r for kind in per_layer_type for r in _rope_params(dict(params[kind]), fields, config)]
    return _rope_params(params, fields, config)


def _rope_params(params: dict[str, Any], fields: ConfigFields, config: Any) -> list[Refusal]:
    params.setdefault("rope_type", params.get("type", "default"))
    refusals = []
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        refusals.append(
            Refusal(
                "rope_type",
                rope_type,
                f"in rope_parameters / rope_scaling; srt computes {', '.join(ROPE_TYPES)}",
            )
        )
    partial = params.get("partial_rotary_factor")
    if partial is None or float(partial) == 1.0:
        return refusals
    if fields.partial_rotary:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        rotary = rotary_dim(head_dim, params)
        if rotary % 2 or (head_dim - rotary) % 2:
            refusals.append(
                Refusal(
                    "partial_rotary_factor",
                    partial,
                    f"{rotary} rotary dims of a head of {head_dim}; srt needs both parts even",
                )
            )
    else:
        refusals.append(
            Refusal(
                "partial_rotary_factor",
                partial,
                "rotary embedding on part of each head; srt rotates all of it",
            )
        )
    return refusals


def _biases(fields: ConfigFields, config: Any) -> list[Refusal]:
    mlp_bias = getattr(config, "mlp_bias", False)
    if fields.mlp_bias and mlp_bias:
        return [Refusal("mlp_bias", mlp_bias, "biases on gate_proj, up_proj and down_proj")]
    return []


def _clip_qkv(fields: ConfigFields, config: Any) -> list[Refusal]:
    clip = getattr(config, "clip_qkv", None)
    if fields.clip_qkv and clip is not None:
        return [Refusal("clip_qkv", clip, "q, k and v clamped to +-clip_qkv")]
    return []


def _sliding_window(fields: ConfigFields, config: Any) -> list[Refusal]:
    """Sliding windows are implemented (models/llama.py's sliding_window_of reads them); an attention
    kind in layer_types other than full and sliding is not."""
    if fields.sliding_window != "layer_types":
        return []
    unknown = sorted(set(getattr(config, "layer_types", None) or []) - set(LAYER_TYPES))
    if unknown:
        return [Refusal("layer_types", unknown, f"attention kinds other than {', '.join(LAYER_TYPES)}")]
    return []


def _softcapping(config: Any) -> list[Refusal]:
    return [
        Refusal(name, value, f"{what} soft-capping, tanh(x / cap) * cap")
        for name, what in (
            ("attn_logit_softcapping", "attention score"),
            ("final_logit_softcapping", "logit"),
        )
        if (value := getattr(config, name, None)) is not None
    ]
