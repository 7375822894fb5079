"""SGLang's and OpenAI's request vocabulary: every request field name srt accepts, in one place.

Sources (update here, then run `python scripts/check_request_fields.py` against a newer sglang):
- sglang 0.5.23: `GenerateReqInput` (srt/managers/io_struct.py), `SamplingParams`
  (srt/sampling/sampling_params.py), `CompletionRequest` and `ChatCompletionRequest` with their
  `PDRoutingFields` base (srt/entrypoints/openai/protocol.py);
- sglang-router 0.3.2: what it adds to the bodies it forwards (`model` on /generate);
- openai 3.57: the official client's `completions.create` and `chat.completions.create` params.

Every field is one of three kinds:
- `impl`: srt parses and honours it (generate_parse.py, sampling_params.py, openai_parse.py);
- `off`: accepted when null, at SGLang's default or at one of the listed values that mean "off";
  any other value is a 400 naming the field and saying srt does not support it (never silently
  ignored);
- `advisory`: accepted with any value, because no value changes what srt returns (a routing hint
  for the router, a label or trace header, a logging switch: srt logs no request content).
Each entry also holds SGLang's default (tests send every field at it, as SGLang's clients do).
A name in none of the lists is a 400 naming it as unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SOURCES = "sglang 0.5.23, sglang-router 0.3.2, openai 3.57"


class VocabularyError(ValueError):
    """A field srt does not know or does not support (an HTTP 400); `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Field:
    kind: str  # "implemented" | "off_only" | "advisory"
    default: Any = None  # SGLang's (or OpenAI's) default
    also: tuple[Any, ...] = ()  # off_only: further values accepted besides null and the default

    @property
    def off_values(self) -> tuple[Any, ...]:
        return (() if self.default is None else (self.default,)) + self.also


def impl(default: Any = None) -> Field:
    return Field("implemented", default)


def advisory(default: Any = None) -> Field:
    return Field("advisory", default)


def off(default: Any = None, *also: Any) -> Field:
    return Field("off_only", default, also)


NONE = off()  # accepted only as null (or absent)

# ---- /generate: GenerateReqInput ----
GENERATE: dict[str, Field] = {
    "text": impl(),
    "input_ids": impl(),
    "sampling_params": impl(),
    "rid": impl(),
    "stream": impl(False),
    "return_logprob": impl(),
    "logprob_start_len": impl(),
    "top_logprobs_num": impl(),
    "return_text_in_logprobs": impl(False),
    "return_prompt_token_ids": impl(False),
    "priority": impl(),
    "log_metrics": impl(True),
    "model": advisory(),  # sglang-router sends it; a worker serves one model
    "routing_key": advisory(),
    "conversation_id": advisory(),  # routing hints for the router
    "no_logs": advisory(False),
    "custom_labels": advisory(),
    "external_trace_header": advisory(),
    "received_time": advisory(),
    "session_id": NONE,
    "session_params": NONE,
    "input_embeds": NONE,
    "image_data": NONE,
    "video_data": NONE,
    "audio_data": NONE,
    "mm_hashes": NONE,
    "mm_content_hashes": NONE,
    "use_audio_in_video": off(False),
    "video_config": NONE,
    "watermark": NONE,
    "token_ids_logprob": impl(),
    "return_sampling_mask": off(None, False),
    "sampling_logprobs_mode": NONE,
    "return_flat_raw_top_logprobs": off(False),
    "return_flat_raw_output_top_logprobs": off(False),
    "return_flat_raw_top_logprobs_b64": off(False),
    "return_hidden_states": off(False),
    "return_routed_experts": impl(False),  # with --enable-return-routed-experts
    "routed_experts_start_len": impl(0),
    "return_indexer_topk": off(False),
    "modalities": NONE,
    "lora_path": impl(),  # an adapter's name (--lora-paths), or one per prompt of a batch
    "lora_id": NONE,
    "custom_logit_processor": NONE,
    "positional_embed_overrides": NONE,
    "bootstrap_host": NONE,
    "bootstrap_port": NONE,
    "bootstrap_room": NONE,
    "bootstrap_pair_key": NONE,
    "decode_tp_size": NONE,
    "routed_dp_rank": off(None, 0),
    "data_parallel_rank": off(None, 0),  # an srt server is one data-parallel rank
    "disagg_prefill_dp_rank": NONE,
    "http_worker_ipc": NONE,
    "background": off(False),
    "require_reasoning": off(False),
    "max_thinking_tokens": NONE,
    "extra_key": NONE,
    "return_bytes": off(False),
    "return_entropy": off(False),
    "need_wait_for_mm_inputs": NONE,
    "num_items_assigned": NONE,
    "encoder_urls": NONE,
    "max_dynamic_patch": NONE,
    "min_dynamic_patch": NONE,
    "image_max_dynamic_patch": NONE,
    "video_max_dynamic_patch": NONE,
    "images_config": NONE,
    "mm_processor_kwargs": NONE,
    "multi_item_delimiter_indices": NONE,
    "token_indices_to_pool": NONE,
    "cache_salt": NONE,
    "kv_hints": NONE,
}

# ---- /generate sampling_params: SamplingParams's API fields (`seed` is srt's own name for sampling_seed) ----
SAMPLING: dict[str, Field] = {
    "max_new_tokens": impl(128),
    "min_new_tokens": impl(0),
    "stop": impl(),
    "stop_token_ids": impl(),
    "stop_regex": impl(),
    "temperature": impl(1.0),
    "top_p": impl(1.0),
    "top_k": impl(1 << 30),
    "min_p": impl(0.0),
    "frequency_penalty": impl(0.0),
    "presence_penalty": impl(0.0),
    "repetition_penalty": impl(1.0),
    "ignore_eos": impl(False),
    "skip_special_tokens": impl(True),
    "spaces_between_special_tokens": impl(True),
    "no_stop_trim": impl(False),
    "logit_bias": impl(),
    "sampling_seed": impl(),
    "seed": impl(),
    "n": impl(1),
    "json_schema": impl(),
    "regex": impl(),
    "ebnf": impl(),
    "structural_tag": impl(),
    "stream_interval": NONE,
    "beam_width": off(None, 1),
    "custom_params": NONE,
    "watermark": NONE,
}

# ---- /v1/completions: CompletionRequest, and the official client's params ----
_PD_ROUTING = {
    "bootstrap_host": NONE,
    "bootstrap_port": NONE,
    "bootstrap_room": NONE,
    "routed_dp_rank": off(None, 0),
    "disagg_prefill_dp_rank": NONE,
}
_OPENAI_COMMON: dict[str, Field] = {
    "frequency_penalty": impl(0.0),
    "presence_penalty": impl(0.0),
    "logit_bias": impl(),
    "n": impl(1),
    "seed": impl(),
    "stop": impl(),
    "stream": impl(False),
    "stream_options": impl(),
    "top_k": impl(-1),
    "min_p": impl(0.0),
    "min_tokens": impl(0),
    "stop_token_ids": impl(),
    "stop_regex": impl(),
    "no_stop_trim": impl(False),
    "ignore_eos": impl(False),
    "skip_special_tokens": impl(True),
    "rid": impl(),
    "priority": impl(),
    "model": advisory("default"),  # any name is served (as in SGLang); replies name the served model
    "user": advisory(),
    "custom_labels": advisory(),
    "response_format": impl(),
    "json_schema": impl(),
    "regex": impl(),
    "ebnf": impl(),
    "return_hidden_states": off(False),
    "return_routed_experts": off(False),
    "routed_experts_start_len": off(0),
    "return_cached_tokens_details": off(False),
    "return_spec_tokens_details": off(False),
    "return_token_ids": off(False),
    "lora_path": NONE,
    "session_id": NONE,
    "session_params": NONE,
    "custom_params": NONE,
    "custom_logit_processor": NONE,
    "watermark": NONE,
    "images_config": NONE,
    "mm_processor_kwargs": NONE,
    "data_parallel_rank": off(None, 0),
    "extra_key": NONE,
    "cache_salt": NONE,
    **_PD_ROUTING,
}
COMPLETION: dict[str, Field] = {
    **_OPENAI_COMMON,
    "prompt": impl(),
    "echo": impl(False),
    "best_of": impl(),
    "logprobs": impl(),
    "max_tokens": impl(16),
    "temperature": impl(1.0),
    "top_p": impl(1.0),
    "repetition_penalty": impl(1.0),
    "suffix": impl(),  # fill-in-the-middle on a model with FIM tokens (srt/fim.py); "" is none
}

# ---- /v1/chat/completions: ChatCompletionRequest, and the official client's params ----
CHAT: dict[str, Field] = {
    **_OPENAI_COMMON,
    "messages": impl(),
    "logprobs": impl(False),
    "top_logprobs": impl(),
    "max_tokens": impl(),
    "max_completion_tokens": impl(),
    "temperature": impl(),
    "top_p": impl(),
    "top_k": impl(),
    "min_p": impl(),
    "repetition_penalty": impl(),
    "continue_final_message": impl(False),
    "chat_template_kwargs": impl(),
    # with --reasoning-parser (srt/reasoning.py); without one there is nothing to split, as SGLang
    "separate_reasoning": impl(True),
    "stream_reasoning": impl(True),
    "metadata": advisory(),
    "prompt_cache_key": advisory(),
    "safety_identifier": advisory(),
    "tools": impl(),
    "tool_choice": impl("auto"),
    "parallel_tool_calls": impl(True),
    "return_prompt_token_ids": off(False),
    "return_meta_info": off(False),
    "return_input_ids_in_sglext": off(False),
    "return_output_ids_in_sglext": off(False),
    "return_sampling_mask": off(False),
    "sampling_logprobs_mode": NONE,
    "return_flat_raw_output_top_logprobs": off(False),
    "return_flat_raw_top_logprobs_b64": off(True, False),
    "reasoning_effort": NONE,
    "thinking": NONE,
    "task": NONE,
    "max_dynamic_patch": NONE,
    "min_dynamic_patch": NONE,
    "use_audio_in_video": off(False),
    "video_config": NONE,
    "input_ids": NONE,
    # the official client's, outside SGLang's schema
    "audio": NONE,
    "function_call": off(None, "none", "auto"),
    "functions": off(None, []),
    "modalities": off(None, ["text"]),
    "moderation": NONE,
    "prediction": NONE,
    "prompt_cache_options": NONE,
    "prompt_cache_retention": NONE,
    "service_tier": off(None, "auto", "default"),
    "store": off(None, False),
    "verbosity": NONE,
    "web_search_options": NONE,
}


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off  # so that True is not taken for 1


def _is_off(value: Any, field: Field, per_item: bool) -> bool:
    if value is None or any(_same(value, off) for off in field.off_values):
        return True
    # a batch may give a field per item (SGLang's `lora_path: [null, null]`)
    return per_item and isinstance(value, list) and all(_is_off(v, field, False) for v in value)


def check_fields(
    body: Mapping[str, Any], vocabulary: Mapping[str, Field], where: str = "", per_item: bool = False
) -> None:
    """VocabularyError for the first field of `body` srt does not know (not in `vocabulary`), else for
    the first off-only field set to a value srt cannot honour. `where` prefixes the names in
    messages and params (e.g. "sampling_params.")."""
    unknown = sorted(set(body) - set(vocabulary))
    if unknown:
        names = ", ".join(where + name for name in unknown)
        raise VocabularyError(f"unknown parameter(s): {names}", where + unknown[0])
    for name, value in body.items():
        field = vocabulary[name]
        if field.kind == "off_only" and not _is_off(value, field, per_item):
            allowed = " or ".join(["null", *(repr(off) for off in field.off_values)])
            raise VocabularyError(
                f"{where}{name}={_short(value)} is not supported by srt (allowed: {allowed})", where + name
            )


def implemented(vocabulary: Mapping[str, Field]) -> frozenset[str]:
    return frozenset(name for name, field in vocabulary.items() if field.kind == "implemented")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
