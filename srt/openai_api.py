"""OpenAI-compatible routes: GET /v1/models, POST /v1/completions and /v1/chat/completions.

Each request becomes a /generate body and runs through the same TokenizerManager
(parse_generate, then generate); the cumulative streamed text becomes OpenAI deltas. Supported: one
prompt, n=1, max_tokens (chat: or max_completion_tokens), temperature, top_p, stop, seed, stream
with stream_options.include_usage, and SGLang's extras top_k, min_p, ignore_eos, stop_token_ids.
Options that would change the output but are not implemented (logprobs, echo, suffix, best_of,
penalties, tools, a non-text response_format, n > 1) get a 400 rather than being ignored. Any
`model` name is accepted (as in SGLang); responses name the served model. finish_reason is "stop",
"length", or "abort" for a request ended by /abort_request.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code": null}}`: 400 for bad
input, 503 when the server cannot serve; a stream that fails midway sends the error as an event,
then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.http_server import read_json_object, sse
from srt.tokenizer_manager import RequestError, ServiceUnavailableError, TokenizerManager

router = APIRouter()

_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options", "user",
           "logprobs", "presence_penalty", "frequency_penalty", "top_k", "min_p", "ignore_eos", "stop_token_ids"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                         "tool_choice", "parallel_tool_calls"}
_PASSED_THROUGH = ("temperature", "top_p", "stop", "seed", "top_k", "min_p", "ignore_eos", "stop_token_ids")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default; chat defaults to the rest of the context


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status == 400 else "service_unavailable_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


@dataclass
class OpenAICall:
    """One OpenAI request translated: the /generate body plus how to shape the reply."""

    chat: bool
    generate_body: dict[str, Any]
    stream: bool
    include_usage: bool
    renamed: dict[str, str]  # /generate parameter -> the OpenAI name the client used

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


# Parameters accepted only with a value meaning "off" (or null): the feature itself is not implemented.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False,), "top_logprobs": (0,),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "tools": ([],), "tool_choice": ("none",),
    "response_format": ({"type": "text"},)}


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off  # so that True is not taken for 1


def _manager(request: Request) -> TokenizerManager:
    return request.app.state.tokenizer_manager


def _model_name(tm: TokenizerManager) -> str:
    return str(tm.server_args.served_model_name or tm.model_info["model_path"])


def _reject_unsupported(body: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown parameter(s): {', '.join(unknown)}", unknown[0])
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
    return params


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
    include_usage = (body.get("stream_options") or {}).get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise RequestError(f"stream_options.include_usage must be a boolean, got {include_usage!r}", "stream_options")
    return stream, include_usage


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
    generate_body = {key: prompt, "stream": stream,
                     "sampling_params": _sampling(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)}
    return OpenAICall(False, generate_body, stream, include_usage,
                      {"text": "prompt", "input_ids": "prompt", "max_new_tokens": "max_tokens"})


def _message_text(message: Any, i: int) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string role", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if content is None:
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
    generate_body = {"input_ids": input_ids, "stream": stream,
                     "sampling_params": _sampling(body, max_name, capacity - len(input_ids))}
    return OpenAICall(True, generate_body, stream, include_usage,
                      {"input_ids": "messages", "text": "messages", "max_new_tokens": max_name})


def _usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": meta["cached_tokens"]}}


def _finish_reason(meta: dict[str, Any]) -> str | None:
    finish = meta["finish_reason"]
    return None if finish is None else str(finish["type"])


def _envelope(call: OpenAICall, rid: str, created: int, model: str, chunk: bool) -> dict[str, Any]:
    name = call.object_name + (".chunk" if chunk and call.chat else "")
    return {"id": ("chatcmpl-" if call.chat else "cmpl-") + rid, "object": name, "created": created, "model": model}


def full_response(call: OpenAICall, out: dict[str, Any], model: str) -> dict[str, Any]:
    meta = out["meta_info"]
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _finish_reason(meta)}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": out["text"]}
    else:
        choice["text"] = out["text"]
    return {**_envelope(call, meta["id"], int(time.time()), model, chunk=False), "choices": [choice],
            "usage": _usage(meta)}


async def stream_chunks(call: OpenAICall, outputs: AsyncGenerator[dict[str, Any], None],
                        model: str) -> AsyncIterator[str]:
    created, sent, last_meta, first = int(time.time()), "", None, True
    async with aclosing(outputs):  # a disconnect closes this generator; close (and abort) the request too
        try:
            async for out in outputs:
                meta = last_meta = out["meta_info"]
                delta = out["text"][len(sent):]  # the text is cumulative; send what is new
                sent = out["text"]
                choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _finish_reason(meta)}
                if call.chat:
                    choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
                    first = False
                else:
                    choice["text"] = delta
                chunk = {**_envelope(call, meta["id"], created, model, chunk=True), "choices": [choice]}
                if call.include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        except ValueError as error:
            yield sse(error_body(400, str(error), getattr(error, "param", None)))
        except ServiceUnavailableError as error:
            yield sse(error_body(503, str(error)))
        else:
            if call.include_usage and last_meta is not None:
                yield sse({**_envelope(call, last_meta["id"], created, model, chunk=True), "choices": [],
                           "usage": _usage(last_meta)})
    yield "data: [DONE]\n\n"


async def _serve(request: Request, chat: bool) -> Response:
    tm = _manager(request)
    renamed: dict[str, str] = {}
    try:
        body = await read_json_object(request)
        call = parse_chat(tm, body) if chat else parse_completion(body)
        renamed = call.renamed
        generate_call = tm.parse_generate(call.generate_body)
    except ValueError as error:
        param = getattr(error, "param", None)
        return error_response(400, str(error), renamed.get(param, param) if param else None)
    except ServiceUnavailableError as error:
        return error_response(503, str(error))
    outputs = tm.generate(generate_call, request)
    model = _model_name(tm)
    if call.stream:
        return StreamingResponse(stream_chunks(call, outputs, model), media_type="text/event-stream")
    try:
        results = [out async for out in outputs]
    except ValueError as error:
        return error_response(400, str(error), getattr(error, "param", None))
    except ServiceUnavailableError as error:
        return error_response(503, str(error))
    if not results:  # the client went away; nobody reads this
        return error_response(400, "the client disconnected")
    return JSONResponse(full_response(call, results[0], model))


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    tm = _manager(request)
    return JSONResponse({"object": "list", "data": [{"id": _model_name(tm), "object": "model", "created": 0,
                                                     "owned_by": "srt", "root": tm.model_info["model_path"]}]})


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)
