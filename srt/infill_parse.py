"""llama.cpp's /infill request body -> a /generate body (InfillCall), validated: bad or unsupported
fields raise RequestError naming the field.

The fields are those of llama.cpp's tools/server (its /infill handler and the /completion
parameters it shares). An absent sampling field takes llama.cpp's default, not srt's: temperature
0.8, top_k 40, top_p 0.95, min_p 0.05, n_predict -1 (up to the end of the context), a random seed.
A field whose llama.cpp meaning srt does not reproduce (penalties over its last-n window, mirostat,
DRY, the `infill` sampler chain, a time limit) is accepted only at its default, as
srt/request_fields.py does for SGLang's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from srt.fim import ExtraChunk, check_text, infill_prompt, require_fim_tokens
from srt.generate_parse import RequestError, check_request_fields, is_int
from srt.request_fields import Field, advisory, impl, off

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager

LLAMA_CPP_RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # LLAMA_DEFAULT_SEED: draw one
INFILL: dict[str, Field] = {
    "input_prefix": impl(),
    "input_suffix": impl(),
    "input_extra": impl(),
    "prompt": impl(),
    "n_predict": impl(-1),
    "max_tokens": impl(),  # llama.cpp's alias of n_predict
    "temperature": impl(0.8),
    "top_k": impl(40),
    "top_p": impl(0.95),
    "min_p": impl(0.05),
    "seed": impl(-1),
    "stop": impl(),
    "stream": impl(False),
    "ignore_eos": impl(False),
    "response_fields": impl(),
    "model": advisory(),
    "cache_prompt": advisory(True),  # srt always reuses cached prefixes (the radix cache)
    "id_slot": advisory(-1),
    "timings_per_token": advisory(False),  # srt returns no timings
    "return_tokens": advisory(False),  # srt always returns them
    "t_max_prompt_ms": advisory(-1),  # llama.cpp does not implement it either
    "n_keep": advisory(0),  # how llama.cpp shifts a full context; srt refuses an overflow instead
    "n_discard": advisory(0),
    "t_max_predict_ms": off(-1, 0),
    "n_indent": off(0),
    "n_probs": off(0),
    "n": off(1),
    "n_cmpl": off(1),
    "samplers": off(),
    "repeat_penalty": off(1.0),
    "presence_penalty": off(0.0),
    "frequency_penalty": off(0.0),
    "typical_p": off(1.0),
    "dynatemp_range": off(0.0),
    "mirostat": off(0),
    "xtc_probability": off(0.0),
    "dry_multiplier": off(0.0),
    # settings of the samplers above, which change nothing while those are off
    "repeat_last_n": advisory(64),
    "dynatemp_exponent": advisory(1.0),
    "mirostat_tau": advisory(5.0),
    "mirostat_eta": advisory(0.1),
    "xtc_threshold": advisory(0.1),
    "dry_base": advisory(1.75),
    "dry_allowed_length": advisory(2),
    "dry_penalty_last_n": advisory(-1),
    "dry_sequence_breakers": advisory(),
    "top_n_sigma": off(-1.0),
    "logit_bias": off(None, []),
    "grammar": off(None, ""),
    "json_schema": off(),
    "lora": off(None, []),
    "post_sampling_probs": off(False),
}
RENAMED = {"input_ids": "input_prefix", "max_new_tokens": "n_predict"}  # /generate's -> /infill's names


@dataclass
class InfillCall:
    """One /infill request translated: the /generate body and what the reply echoes."""

    generate_body: dict[str, Any]
    prompt_ids: list[int]
    stream: bool
    settings: dict[str, Any]  # llama.cpp's generation_settings: the values used
    renamed: dict[str, str]  # /generate's names -> the body's, for a 400's param
    response_fields: list[str] = field(default_factory=list)  # empty: every field


def _extra(value: Any) -> list[ExtraChunk]:
    """input_extra: a list of {"filename": str (optional), "text": str}."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(
            'input_extra must be a list of {"filename": string, "text": string}', "input_extra"
        )
    chunks = []
    for i, chunk in enumerate(value):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise RequestError(f"input_extra[{i}] must be an object with a string text", "input_extra")
        unknown = sorted(set(chunk) - {"filename", "text"})
        if unknown:
            raise RequestError(f"input_extra[{i}] has unknown field(s): {', '.join(unknown)}", "input_extra")
        filename = chunk.get("filename", "tmp")
        chunks.append(
            ExtraChunk(check_text(chunk["text"], "input_extra"), check_text(filename, "input_extra"))
        )
    return chunks


def _number(body: dict[str, Any], name: str) -> Any:
    value = body.get(name)
    value = INFILL[name].default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    return value


def _requested_tokens(body: dict[str, Any]) -> tuple[int, str]:
    """(n_predict or its alias max_tokens, the name given); -1: up to the end of the context."""
    name = (
        "max_tokens" if body.get("n_predict") is None and body.get("max_tokens") is not None else "n_predict"
    )
    value = body.get(name)
    value = -1 if value is None else value
    if not is_int(value) or value < -1:
        raise RequestError(f"{name} must be an integer >= -1 (-1: up to the end of the context)", name)
    return int(value), name


def _max_new_tokens(tm: TokenizerManager, requested: int, prompt_len: int) -> int:
    if requested >= 0:
        return requested
    capacity = min(tm.context_length, tm.max_total_tokens or tm.context_length)
    if prompt_len >= capacity:
        raise RequestError(
            f"the prompt takes {prompt_len} tokens, leaving none of the {capacity} the server can hold",
            "input_prefix",
        )
    return capacity - prompt_len


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
        raise RequestError("stop must be a list of strings", "stop")
    return [word for word in value if word]  # llama.cpp skips empty words


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """/generate's sampling_params for llama.cpp's fields (max_new_tokens comes with the prompt)."""
    top_k = _number(body, "top_k")
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise RequestError(f"seed must be an integer, got {seed!r}", "seed")
    sampling: dict[str, Any] = {
        "temperature": max(0.0, float(_number(body, "temperature"))),  # <= 0: greedy, as llama.cpp
        "top_k": int(top_k) if top_k > 0 else -1,  # <= 0: every token
        "top_p": float(_number(body, "top_p")),
        "min_p": float(_number(body, "min_p")),
        "stop": _stop(body.get("stop")),
        "ignore_eos": body.get("ignore_eos") or False,
    }
    if seed is not None and seed not in LLAMA_CPP_RANDOM_SEEDS:
        sampling["seed"] = seed
    return sampling


def _response_fields(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(path, str) for path in value):
        raise RequestError("response_fields must be a list of strings", "response_fields")
    return list(value)


def _text(body: dict[str, Any], name: str, required: bool) -> str:
    if name not in body and required:
        raise RequestError(f"{name} is required", name)
    value = body.get(name)
    return "" if value is None and not required else check_text(value, name)


def parse_infill(tm: TokenizerManager, body: dict[str, Any]) -> InfillCall:
    """The whole body is checked before the model's FIM tokens are asked for, so bad input is named
    on any model."""
    check_request_fields(body, INFILL)
    prefix, suffix = _text(body, "input_prefix", True), _text(body, "input_suffix", True)
    prompt, extra = _text(body, "prompt", False), _extra(body.get("input_extra"))
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
    sampling, (requested, requested_name) = _sampling(body), _requested_tokens(body)
    response_fields = _response_fields(body.get("response_fields"))
    fim = require_fim_tokens(tm.tokenizer, "input_suffix", "/infill")
    prompt_ids = infill_prompt(tm.tokenizer, fim, prefix, suffix, extra, prompt)
    sampling["max_new_tokens"] = _max_new_tokens(tm, requested, len(prompt_ids))
    sampling["stop_token_ids"] = [] if sampling["ignore_eos"] is True else list(fim.end_ids)
    settings = {
        "n_predict": sampling["max_new_tokens"],
        "seed": sampling.get("seed", -1),
        **{name: sampling[name] for name in ("temperature", "top_k", "top_p", "min_p", "stop", "ignore_eos")},
        "stream": stream,
    }
    renamed = {**RENAMED, "max_new_tokens": requested_name}
    return InfillCall(
        {"input_ids": prompt_ids, "stream": stream, "sampling_params": sampling},
        prompt_ids,
        stream,
        settings,
        renamed,
        response_fields,
    )
