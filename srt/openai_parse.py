"""OpenAI request bodies -> /generate bodies (OpenAICall), validated: bad or unsupported
parameters raise RequestError naming the OpenAI parameter (see openai_api.py for what is
supported)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from srt.generate_parse import RequestError

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager

_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options", "user",
           "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p", "ignore_eos",
           "stop_token_ids", "min_tokens"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                         "tool_choice", "parallel_tool_calls"}
_PASSED_THROUGH = ("temperature", "top_p", "stop", "seed", "top_k", "min_p", "ignore_eos", "stop_token_ids",
                   "frequency_penalty", "presence_penalty", "repetition_penalty")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default; chat defaults to the rest of the context
MAX_N = 128
MAX_TOP_LOGPROBS = 20


@dataclass
class OpenAICall:
    """One OpenAI request translated: the /generate body plus how to shape the reply."""

    chat: bool
    generate_body: dict[str, Any]
    stream: bool
    include_usage: bool
    renamed: dict[str, str]  # /generate parameter -> the OpenAI name the client used
    n: int = 1
    logprobs: bool = False

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


# Parameters accepted only with a value meaning "off" (or null): the feature itself is not implemented.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "echo": (False,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",),
    "response_format": ({"type": "text"},)}


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off  # so that True is not taken for 1


def reject_unknown(body: dict[str, Any], known: set[str]) -> None:
    """RequestError naming the first of body's fields that is not in `known`."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown parameter(s): {', '.join(unknown)}", unknown[0])


def _reject_unsupported(body: dict[str, Any], known: set[str]) -> None:
    reject_unknown(body, known)
    for name, value in body.items():
        if value is not None and name in _OFF_VALUES and not any(_same(value, off) for off in _OFF_VALUES[name]):
            off_values = " or ".join(repr(off) for off in _OFF_VALUES[name])
            raise RequestError(f"{name}={value!r} is not supported yet (allowed: {off_values})", name)
    stream_options = body.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}):
        raise RequestError("stream_options must be an object with only include_usage", "stream_options")


def _sampling(body: dict[str, Any], max_tokens_name: str, default_max: int | None) -> dict[str, Any]:
    params = {name: body[name] for name in _PASSED_THROUGH if body.get(name) is not None}
    max_tokens = body.get(max_tokens_name)
    params["max_new_tokens"] = default_max if max_tokens is None else max_tokens
    if body.get("min_tokens") is not None:  # vLLM's and SGLang's name for min_new_tokens
        params["min_new_tokens"] = body["min_tokens"]
    return params


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
    include_usage = (body.get("stream_options") or {}).get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise RequestError(f"stream_options.include_usage must be a boolean, got {include_usage!r}", "stream_options")
    return stream, include_usage


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _n(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    return int(n)


def _top_logprobs(value: Any, name: str) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}", name)
    return int(value)


def _logprob_fields(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The /generate logprob fields for the OpenAI options (empty when logprobs are not asked for)."""
    if chat:
        want = body.get("logprobs") or False
        if not isinstance(want, bool):
            raise RequestError(f"logprobs must be a boolean, got {want!r}", "logprobs")
        top = body.get("top_logprobs")
        top = 0 if top is None else _top_logprobs(top, "top_logprobs")
        if top and not want:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    else:
        want = body.get("logprobs") is not None
        top = _top_logprobs(body["logprobs"], "logprobs") if want else 0
    return {"return_logprob": True, "top_logprobs_num": top, "return_text_in_logprobs": True} if want else {}


def _derived_seed(seed: int, i: int) -> int:
    return seed if i == 0 else (seed + i * 0x9E3779B97F4A7C15) % 2**63


def _fan_out(generate_body: dict[str, Any], prompt_key: str, n: int) -> dict[str, Any]:
    """n > 1: a /generate batch of n copies of the prompt; a given seed yields n derived seeds."""
    if n == 1:
        return generate_body
    params = generate_body["sampling_params"]
    seed = params.get("seed")
    return {**generate_body, prompt_key: [generate_body[prompt_key]] * n,
            "sampling_params": [{**params, "seed": _derived_seed(seed, i)} if _is_int(seed) else params
                                for i in range(n)]}


def parse_completion(body: dict[str, Any]) -> OpenAICall:
    _reject_unsupported(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        key = "text"
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        key = "input_ids"
    else:
        raise RequestError("prompt must be a string or a list of token ids (one prompt only)", "prompt")
    stream, include_usage = _stream_flags(body)
    n, logprobs = _n(body), _logprob_fields(body, chat=False)
    generate_body = {key: prompt, "stream": stream, **logprobs,
                     "sampling_params": _sampling(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)}
    return OpenAICall(False, _fan_out(generate_body, key, n), stream, include_usage,
                      {"text": "prompt", "input_ids": "prompt", "max_new_tokens": "max_tokens",
                       "min_new_tokens": "min_tokens", "return_logprob": "logprobs", "top_logprobs_num": "logprobs"}, n, bool(logprobs))


def _message_text(message: Any, i: int) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string role", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if content is None:
        if message["role"] != "assistant":  # an assistant turn may carry only tool calls; no other may be empty
            raise RequestError(f"messages[{i}].content is required for a {message['role']} message", "messages")
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": message["role"], "content": content}


def parse_chat(tm: TokenizerManager, body: dict[str, Any]) -> OpenAICall:
    _reject_unsupported(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    conversation = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        text = tm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except (ValueError, jinja2.TemplateError) as error:  # no chat template, or raise_exception() in it
        raise RequestError(f"cannot apply the chat template: {error}", "messages") from None
    # The template already wrote the special tokens (BOS included), so do not add them again.
    input_ids = list(tm.tokenizer(text, add_special_tokens=False)["input_ids"])
    capacity = min(tm.context_length, tm.max_total_tokens or tm.context_length)
    if len(input_ids) >= capacity:
        raise RequestError(f"the messages take {len(input_ids)} tokens, leaving none of the {capacity} "
                           "the server can hold", "messages")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream, include_usage = _stream_flags(body)
    n, logprobs = _n(body), _logprob_fields(body, chat=True)
    generate_body = {"input_ids": input_ids, "stream": stream, **logprobs,
                     "sampling_params": _sampling(body, max_name, capacity - len(input_ids))}
    return OpenAICall(True, _fan_out(generate_body, "input_ids", n), stream, include_usage,
                      {"input_ids": "messages", "text": "messages", "max_new_tokens": max_name,
                       "min_new_tokens": "min_tokens", "return_logprob": "logprobs", "top_logprobs_num": "top_logprobs"}, n, bool(logprobs))
