"""OpenAI request bodies -> /generate bodies (OpenAICall), validated: bad or unsupported
parameters raise RequestError naming the OpenAI parameter. srt/request_fields.py lists the fields
(OpenAI's, and SGLang's extensions) and which are implemented. A chat body is read into the typed
ChatRequest (srt/conversation/request.py), as Anthropic's and Responses' bodies are by their own
adapters; conversation/call.py's chat_call makes the generate call of any of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from srt.conversation import Conversation, openai_chat
from srt.conversation.call import ChatCall, chat_call
from srt.conversation.read import template_kwargs
from srt.conversation.render import ChatPrompt, render_prompt
from srt.conversation.request import ChatRequest
from srt.fim import FimTokens, check_text, fim_prompt, require_fim_tokens, text_ids
from srt.generate_parse import RequestError, check_request_fields
from srt.request_fields import CHAT, COMPLETION, Field

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager

# OpenAI and SGLang names that /generate's sampling_params know by the same name
_PASSED_THROUGH = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "top_k",
    "min_p",
    "ignore_eos",
    "stop_token_ids",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop_regex",
    "no_stop_trim",
    "skip_special_tokens",
)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default; chat defaults to the rest of the context
MAX_N = 128
MAX_TOP_LOGPROBS = 20


@dataclass
class OpenAICall(ChatCall):
    """One OpenAI request's generate call: a chat's, or a completion's (a batch of prompts, echo)."""

    chat: bool = True
    prompts: int = 1  # completions may send a batch of prompts: choice i * n + j is copy j of prompt i
    echo: list[str] | None = None  # completions with echo: each prompt's text, which its choices start with

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def choices(self) -> int:
        return self.prompts * self.n


def reject_unknown(body: dict[str, Any], known: set[str]) -> None:
    """RequestError naming the first of body's fields that is not in `known`."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown parameter(s): {', '.join(unknown)}", unknown[0])


def _check_vocabulary(body: dict[str, Any], vocabulary: dict[str, Field]) -> None:
    check_request_fields(body, vocabulary)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {
            "include_usage",
            "continuous_usage_stats",
        }:
            raise RequestError(
                "stream_options must be an object with include_usage (and continuous_usage_stats)",
                "stream_options",
            )
        if stream_options.get("continuous_usage_stats"):
            raise RequestError(
                "stream_options.continuous_usage_stats=true is not supported by srt", "stream_options"
            )


def _sampling(body: dict[str, Any], n: int) -> dict[str, Any]:
    """/generate's sampling_params of the OpenAI options, but for the token limit."""
    params = {name: body[name] for name in _PASSED_THROUGH if body.get(name) is not None}
    if body.get("min_tokens") is not None:  # vLLM's and SGLang's name for min_new_tokens
        params["min_new_tokens"] = body["min_tokens"]
    if n > 1:
        params["n"] = n
    params.update(_response_format(body))
    return params


def _response_format(body: dict[str, Any]) -> dict[str, Any]:
    """The /generate grammar for response_format (as SGLang: json_object is any JSON object,
    json_schema its schema, structural_tag the whole object), and SGLang's own json_schema /
    regex / ebnf fields. `strict` is honoured either way: srt always constrains."""
    params = {name: body[name] for name in ("json_schema", "regex", "ebnf") if body.get(name) is not None}
    fmt = body.get("response_format")
    if fmt is None:
        return params
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError("response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return params
    if params:
        raise RequestError(
            f"response_format and {next(iter(params))} are both set: give one", "response_format"
        )
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError(
                "response_format.json_schema must be an object with name and schema", "response_format"
            )
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, dict):
            raise RequestError(
                "response_format.json_schema.schema is required (a JSON schema object)", "response_format"
            )
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise RequestError(
                f"response_format.json_schema.strict must be a boolean, got {spec['strict']!r}",
                "response_format",
            )
        return {"json_schema": orjson.dumps(schema).decode()}
    if kind == "structural_tag":
        return {"structural_tag": orjson.dumps(fmt).decode()}
    raise RequestError(
        f"response_format.type must be text, json_object, json_schema or structural_tag, got {kind!r}",
        "response_format",
    )


def _grammar_names(body: dict[str, Any]) -> dict[str, str]:
    """/generate's grammar parameters -> the OpenAI name the client used (for a 400's param)."""
    if body.get("response_format") is None:
        return {}
    return {"json_schema": "response_format", "structural_tag": "response_format"}


def _request_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The /generate fields the OpenAI routes take by the same name (SGLang's extensions)."""
    return {name: body[name] for name in ("rid", "priority") if body.get(name) is not None}


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
    include_usage = (body.get("stream_options") or {}).get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise RequestError(
            f"stream_options.include_usage must be a boolean, got {include_usage!r}", "stream_options"
        )
    return stream, include_usage


def _reasoning_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """separate_reasoning / stream_reasoning (SGLang's fields, both true by default): the split needs
    --reasoning-parser; without one the output is all content, as SGLang's."""
    flags = []
    for name in ("separate_reasoning", "stream_reasoning"):
        value = body.get(name, True)
        if not isinstance(value, bool):
            raise RequestError(f"{name} must be a boolean, got {value!r}", name)
        flags.append(value)
    return flags[0], flags[1]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _n(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        n = 1
    elif not _is_int(n) or not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != n):
        raise RequestError(
            f"best_of must equal n ({n}): srt returns every completion it generates, got {best_of!r}",
            "best_of",
        )
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


def _completion_prompts(prompt: Any) -> tuple[str, Any, int]:
    """(the /generate key, its value, the number of prompts): one string or list of token ids, or
    a batch of either."""
    if isinstance(prompt, str):
        return "text", prompt, 1
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return "input_ids", prompt, 1
        if all(isinstance(p, str) for p in prompt):
            return "text", prompt, len(prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return "input_ids", prompt, len(prompt)
    raise RequestError(
        "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt"
    )


def _fim_prompts(
    tm: TokenizerManager, body: dict[str, Any], prompt: Any, batch: bool
) -> tuple[Any, FimTokens] | None:
    """With a non-empty `suffix`: each prompt as the prefix of a fill-in-the-middle prompt (srt/fim.py),
    as token ids, and the model's FIM tokens; None without one."""
    suffix = body.get("suffix")
    if suffix is None or suffix == "":
        return None
    suffix_ids = text_ids(tm.tokenizer, check_text(suffix, "suffix"))
    fim = require_fim_tokens(tm.tokenizer, "suffix")
    if body.get("echo"):
        raise RequestError("echo cannot be combined with suffix (fill-in-the-middle)", "suffix")
    items = prompt if batch else [prompt]
    ids = [
        fim_prompt(
            fim, p if isinstance(p, list) else text_ids(tm.tokenizer, check_text(p, "prompt")), suffix_ids
        )
        for p in items
    ]
    return (ids if batch else ids[0]), fim


def _fim_stops(sampling: dict[str, Any], fim: FimTokens) -> None:
    """A FIM completion also ends where the model closes the middle (FimTokens.end_ids), unless it
    ignores EOS (as llama.cpp's ignore_eos masks every end-of-generation token)."""
    given = sampling.get("stop_token_ids") or []
    if isinstance(given, list) and sampling.get("ignore_eos") is not True:  # else /generate's parser names it
        sampling["stop_token_ids"] = list(dict.fromkeys([*given, *fim.end_ids]))


def parse_completion(tm: TokenizerManager, body: dict[str, Any]) -> OpenAICall:
    _check_vocabulary(body, COMPLETION)
    key, prompt, prompts = _completion_prompts(body.get("prompt"))
    batch = isinstance(prompt, list) and (key == "text" or isinstance(prompt[0], list))
    fim = _fim_prompts(tm, body, prompt, batch)
    if fim is not None:
        key, prompt = "input_ids", fim[0]
    stream, include_usage = _stream_flags(body)
    n, logprobs = _n(body), _logprob_fields(body, chat=False)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise RequestError(f"echo must be a boolean, got {echo!r}", "echo")
    echo_texts: list[str] | None = None
    if echo:
        items = prompt if batch else [prompt]
        echo_texts = [p if isinstance(p, str) else str(tm.tokenizer.decode(p)) for p in items]
        if logprobs:
            logprobs["logprob_start_len"] = 0  # the prompt's tokens are scored too
    generate_body = {
        key: prompt,
        "stream": stream,
        **logprobs,
        **_request_fields(body),
        "sampling_params": {**_sampling(body, n), "max_new_tokens": _max_tokens(body, "max_tokens")},
    }
    if fim is not None:
        _fim_stops(generate_body["sampling_params"], fim[1])
    renamed = {
        "text": "prompt",
        "input_ids": "prompt",
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
        "return_logprob": "logprobs",
        "top_logprobs_num": "logprobs",
        "logprob_start_len": "echo",
        **_grammar_names(body),
    }
    return OpenAICall(
        generate_body,
        stream,
        renamed,
        n=n,
        include_usage=include_usage,
        logprobs=bool(logprobs),
        chat=False,
        prompts=prompts,
        echo=echo_texts,
    )


def _template_options(body: dict[str, Any], conversation: Conversation) -> dict[str, Any]:
    """apply_chat_template's arguments for continue_final_message and chat_template_kwargs."""
    extra = template_kwargs(body.get("chat_template_kwargs"))
    continue_final = body.get("continue_final_message") or False
    if not isinstance(continue_final, bool):
        raise RequestError(
            f"continue_final_message must be a boolean, got {continue_final!r}", "continue_final_message"
        )
    if continue_final and conversation.messages[-1].role != "assistant":
        raise RequestError(
            "continue_final_message needs the last message to be the assistant's", "continue_final_message"
        )
    if continue_final:  # no generation prompt after it (as SGLang and transformers)
        extra.update(add_generation_prompt=False, continue_final_message=True)
    return extra


def _max_tokens(body: dict[str, Any], name: str) -> Any:
    return COMPLETION_DEFAULT_MAX_TOKENS if body.get(name) is None else body[name]


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """The typed request of a chat body; RequestError naming the OpenAI field."""
    _check_vocabulary(body, CHAT)
    conversation = openai_chat.conversation(body.get("messages"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream, include_usage = _stream_flags(body)
    n = _n(body)
    separate, stream_reasoning = _reasoning_flags(body)
    return ChatRequest(
        conversation,
        openai_chat.tools(body.get("tools")),
        openai_chat.tool_choice(body.get("tool_choice")),
        parallel_tool_calls=parallel is not False,
        sampling=_sampling(body, n),
        max_tokens=body.get(max_name),
        stream=stream,
        include_usage=include_usage,
        n=n,
        logprobs=_logprob_fields(body, chat=True),
        separate_reasoning=separate,
        stream_reasoning=stream_reasoning,
        template_options=_template_options(body, conversation),
        request_fields=_request_fields(body),
        names={
            "input_ids": "messages",
            "max_new_tokens": max_name,
            "min_new_tokens": "min_tokens",
            "return_logprob": "logprobs",
            "top_logprobs_num": "top_logprobs",
            **_grammar_names(body),
        },
    )


def chat_prompt(tm: TokenizerManager, body: dict[str, Any]) -> ChatPrompt:
    """The prompt of a chat body: its messages and tools through the chat template."""
    return render_prompt(tm, chat_request(body))


def parse_chat(tm: TokenizerManager, body: dict[str, Any]) -> OpenAICall:
    return chat_call(tm, chat_request(body), OpenAICall)
