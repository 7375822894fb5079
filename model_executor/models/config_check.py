"""The config.json fields that change a model's math, and the start-up check that refuses a value srt
does not implement, naming the field, instead of serving a different model than the one trained.

Decided from transformers 5's modeling_{llama,mistral,qwen2,qwen3,qwen2_moe,qwen3_moe,mixtral,olmoe}.py. Each model class declares in
`config_fields` which architecture-specific fields its transformers code reads; the rest of the
table holds for every registered architecture.

| field (config.json) | transformers reads it in | srt |
|---|---|---|
| hidden_act | all: down(act(gate) * up) | "silu" and "swish" (both SiLU); others refused |
| rope_type (rope_parameters / rope_scaling) | all | default, linear, llama3 (layers/rotary.py); dynamic, yarn, longrope, ... refused |
| partial_rotary_factor | linear, llama3 rope (below 1 the shapes break); default rope ignores it | refused unless 1: srt rotates the whole head |
| rope_parameters per layer type | none of them (they read the top-level keys) | refused |
| attention_bias | Llama, Qwen3: biases on q, k, v and o | implemented (Qwen2: q, k, v always; Mistral: never) |
| mlp_bias | Llama: biases on gate, up and down | refused when true |
| sliding_window | Mistral: every layer, when not null (Llama: not read) | refused when narrower than the served context |
| layer_types (where config.json has none: from use_sliding_window, sliding_window, max_window_layers) | Qwen2, Qwen3 | "sliding_attention" layers as Mistral's; other kinds refused |
| attn_logit_softcapping, final_logit_softcapping | none of them (Gemma 2's) | refused when set: a checkpoint that sets one was trained with it |
| head_dim | all | implemented |
| num_experts / num_local_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob | the MoE models | implemented (models/moe.py) |
| decoder_sparse_step, mlp_only_layers | Qwen2-MoE, Qwen3-MoE: which layers are sparse | implemented |
| shared_expert_intermediate_size | Qwen2-MoE: the gated shared expert | implemented |
| qkv_bias | Qwen2-MoE: biases on q, k, v | implemented |
| clip_qkv | OLMoE: q, k and v clamped to +-clip_qkv | refused when set |
| router_aux_loss_coef, output_router_logits, router_jitter_noise | training only (the load-balancing loss, jitter while training) | ignored |
| attention_dropout | training only | ignored |
| pretraining_tp | none of them (transformers 4 split the matmuls, same math) | ignored |

A sliding window of w tokens lets position q attend to keys q-w+1 .. q; with a context of c tokens
(positions 0 .. c-1) that is every key as long as w >= c, so a window at least as wide as the context
srt serves is full attention, exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from model_executor.layers.rotary import ROPE_TYPES, rope_parameters

SILU_ACTS = ("silu", "swish")  # transformers' ACT2FN makes both SiLU; srt's MLP is silu(gate) * up
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
        *_activation(config),
        *_rope(config),
        *_biases(fields, config),
        *_clip_qkv(fields, config),
        *_sliding_window(fields, config, context_length),
        *_softcapping(config),
    ]
    if refusals:
        listed = ", ".join(f"{r.field}={json.dumps(r.value)} ({r.what})" for r in refusals)
        verb = "is" if len(refusals) == 1 else "are"
        remedies = "".join(f"; {r.remedy}" for r in refusals if r.remedy)
        raise ValueError(f"config.json: {listed} {verb} not implemented by srt for {architecture}{remedies}")


def _activation(config: Any) -> list[Refusal]:
    act = getattr(config, "hidden_act", "silu")
    if act in SILU_ACTS:
        return []
    return [Refusal("hidden_act", act, "the MLP's activation; srt computes silu(gate) * up")]


def _rope(config: Any) -> list[Refusal]:
    params = rope_parameters(config)
    per_layer_type = sorted(key for key, value in params.items() if isinstance(value, dict))
    if per_layer_type:
        return [Refusal("rope_parameters", per_layer_type, "a rope setting per layer type")]
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
    if partial is not None and float(partial) != 1.0:
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


def _sliding_window(fields: ConfigFields, config: Any, context_length: int) -> list[Refusal]:
    if fields.sliding_window == "ignored":
        return []
    refusals = []
    where = "in every layer"
    if fields.sliding_window == "layer_types":
        layer_types = list(getattr(config, "layer_types", None) or [])
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            refusals.append(
                Refusal("layer_types", unknown, f"attention kinds other than {', '.join(LAYER_TYPES)}")
            )
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        if not sliding:
            return refusals
        where = f"in layers {_spans(sliding)} (layer_types, from use_sliding_window and max_window_layers)"
    window = getattr(config, "sliding_window", None)
    if window is not None and int(window) < context_length:
        refusals.append(
            Refusal(
                "sliding_window",
                window,
                f"sliding-window attention {where}, narrower than the {context_length}-token context",
                f"--context-length {window} or less serves this model exactly (full attention then sees "
                "the same keys)",
            )
        )
    return refusals


def _softcapping(config: Any) -> list[Refusal]:
    return [
        Refusal(name, value, f"{what} soft-capping, tanh(x / cap) * cap")
        for name, what in (
            ("attn_logit_softcapping", "attention score"),
            ("final_logit_softcapping", "logit"),
        )
        if (value := getattr(config, name, None)) is not None
    ]


def _spans(indices: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
