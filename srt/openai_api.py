"""OpenAI-compatible routes: GET /v1/models, POST /v1/completions and /v1/chat/completions.

Each request becomes a /generate body and runs through the same TokenizerManager
(parse_generate, then generate); the cumulative streamed text becomes OpenAI deltas. The fields
are OpenAI's and SGLang's extensions (srt/request_fields.py: which are implemented; an option that
would change the output but is not implemented, such as beam search, is a 400 rather than ignored;
response_format constrains the output with a grammar, srt/openai_parse.py). Completions take a batch of prompts (choice i * n + j is copy j of
prompt i), `echo` (with `logprobs`, the prompt's tokens are scored too, the first one null, as
lm-eval-harness's loglikelihood requests need), `best_of` equal to `n`, and `suffix` (the prompt
and it become the model's fill-in-the-middle prompt, srt/fim.py). n (1..128) runs n
requests with seeds derived from `seed`, as one /generate batch. Any `model` name is accepted (as
in SGLang); responses name the served model. With --enable-lora, `model` as base:adapter (SGLang)
or an adapter's name (vLLM) runs the request under that adapter; /v1/models lists the adapters
with the base model as `parent`. finish_reason is "stop", "length", or "abort" for a
request ended by /abort_request.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code": null}}`
(http_common.openai_error_body): 400 for bad input, 503 when the server cannot serve; a stream
that fails midway sends the error as an event, then `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.conversation.reply import Reply, ReplyReader, Usage
from srt.http_common import (
    OPENAI_ERRORS,
    manager,
    openai_error_body,
    queue_refusal,
    read_json_object,
    refused_stream,
    sse,
    sse_stream,
)
from srt.openai_logprobs import chat_logprobs, completion_logprobs
from srt.openai_parse import OpenAICall, parse_chat, parse_completion
from srt.repeated_calls import end_at_repeated_call
from srt.request_state import ServiceUnavailableError
from srt.tokenizer_manager import TokenizerManager
from srt.tool_calls import ToolCall

router = APIRouter()


def _model_name(tm: TokenizerManager) -> str:
    return tm.server_args.model_name


def _usage(metas: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Usage of the choices (n per prompt, in order): each prompt counts once."""
    usages = [Usage.of(meta) for meta in metas]
    firsts = usages[::n]
    prompt = sum(usage.prompt_tokens for usage in firsts)
    completion = sum(usage.completion_tokens for usage in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(usage.cached_tokens for usage in firsts)},
    }


def _finish_reason(meta: dict[str, Any]) -> str | None:
    finish = meta["finish_reason"]
    return None if finish is None else str(finish["type"])


def _envelope(call: OpenAICall, rid: str, created: int, model: str, chunk: bool) -> dict[str, Any]:
    name = call.object_name + (".chunk" if chunk and call.chat else "")
    return {
        "id": ("chatcmpl-" if call.chat else "cmpl-") + rid,
        "object": name,
        "created": created,
        "model": model,
    }


@dataclass
class ChoiceProgress:
    """What one choice has sent so far (a stream sends only what is new): a chat's reply, a
    completion's text, the tokens whose logprobs went out."""

    reply: ReplyReader = field(default_factory=ReplyReader)
    text: str = ""
    tokens: int = 0  # output tokens whose logprobs were sent
    text_offset: int = 0  # completions: where the next token's text starts
    first: bool = True


def _logprobs(call: OpenAICall, meta: dict[str, Any], progress: ChoiceProgress) -> dict[str, Any] | None:
    """The logprobs object of the choice's tokens not sent yet (None when not asked for); with echo
    the first one starts with the prompt's."""
    if not call.logprobs:
        return None
    start = progress.tokens
    tokens = meta["output_token_logprobs"][start:]
    tops = meta.get("output_top_logprobs")
    tops = tops[start:] if tops is not None else None
    progress.tokens += len(tokens)
    if call.echo is not None and progress.first:
        tokens = meta.get("input_token_logprobs", []) + tokens
        if tops is not None:
            tops = meta.get("input_top_logprobs", []) + tops
    if call.chat:
        return chat_logprobs(tokens, tops)
    obj, progress.text_offset = completion_logprobs(tokens, tops, progress.text_offset)
    return obj


def _choice(call: OpenAICall, out: dict[str, Any], progress: ChoiceProgress, chunk: bool) -> dict[str, Any]:
    """One choice of a response (chunk False) or what is new in it since `progress` (a stream's
    delta): a completion's text, or a chat's message (content, reasoning_content, tool_calls)."""
    meta = out["meta_info"]
    choice: dict[str, Any] = {
        "index": out.get("index", 0),
        "logprobs": _logprobs(call, meta, progress),
        "finish_reason": _finish_reason(meta),
    }
    if call.chat:
        reply = progress.reply.read(out, whole=not chunk)
        choice["finish_reason"] = reply.finish_reason
        choice["delta" if chunk else "message"] = _message(reply, chunk)
        return choice
    text = out["text"][len(progress.text) :]  # the text is cumulative; send what is new
    progress.text = out["text"]
    if call.echo is not None and progress.first:
        text = call.echo[choice["index"] // call.n] + text
    progress.first = False
    choice["text"] = text
    return choice


def _message(reply: Reply, chunk: bool) -> dict[str, Any]:
    """A reply as OpenAI's assistant message, or a stream's delta of one (each call with its index)."""
    message: dict[str, Any] = {"role": "assistant"} if reply.first or not chunk else {}
    message["content"] = reply.content
    if reply.tool_calls:
        message["tool_calls"] = [
            _tool_call(c, reply.calls_before + i if chunk else None) for i, c in enumerate(reply.tool_calls)
        ]
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    return message


def _tool_call(call: ToolCall, index: int | None) -> dict[str, Any]:
    """OpenAI's tool call object, its id minted here; a stream's deltas also carry the call's index."""
    out = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


def full_response(call: OpenAICall, outs: list[dict[str, Any]], model: str) -> dict[str, Any]:
    outs = sorted(outs, key=lambda out: out.get("index", 0))
    choices = [_choice(call, out, ChoiceProgress(call.reply_reader()), chunk=False) for out in outs]
    metas = [out["meta_info"] for out in outs]
    return {
        **_envelope(call, metas[0]["id"], int(time.time()), model, chunk=False),
        "choices": choices,
        "usage": _usage(metas, call.n),
    }


def stream_chunks(
    call: OpenAICall, outputs: AsyncGenerator[dict[str, Any], None], model: str
) -> AsyncIterator[bytes]:
    """The response's chunks as server-sent events, then [DONE] (an error midway: an error event)."""
    return sse_stream(outputs, _chunks(call, outputs, model), OPENAI_ERRORS)


async def _chunks(
    call: OpenAICall, outputs: AsyncGenerator[dict[str, Any], None], model: str
) -> AsyncGenerator[bytes, None]:
    created, chunk_id = int(time.time()), None
    progress: dict[int, ChoiceProgress] = {}
    last_metas: dict[int, dict[str, Any]] = {}
    async for out in outputs:
        index = out.get("index", 0)
        last_metas[index] = out["meta_info"]
        chunk_id = chunk_id or out["meta_info"]["id"]  # one id for every chunk of the response
        choice = _choice(
            call, out, progress.setdefault(index, ChoiceProgress(call.reply_reader())), chunk=True
        )
        chunk = {**_envelope(call, chunk_id, created, model, chunk=True), "choices": [choice]}
        if call.include_usage:
            chunk["usage"] = None
        yield sse(chunk)
    if call.include_usage and chunk_id is not None:
        yield sse(
            {
                **_envelope(call, chunk_id, created, model, chunk=True),
                "choices": [],
                "usage": _usage([last_metas[i] for i in sorted(last_metas)], call.n),
            }
        )


async def _serve(request: Request, chat: bool) -> Response:
    tm = manager(request)
    renamed: dict[str, str] = {}
    try:
        tm.check_kind(embed=False)
        body = await read_json_object(request)
        call = parse_chat(tm, body) if chat else parse_completion(tm, body)
        renamed = call.renamed
        adapter = tm.lora_of_model(body.get("model"))  # base:adapter or the adapter's name
        if adapter is not None:
            call.generate_body["lora_path"] = adapter
        generate_call = tm.parse_generate(call.generate_body)
    except (ValueError, ServiceUnavailableError) as error:
        return OPENAI_ERRORS.of(error, renamed)
    outputs = end_at_repeated_call(call, tm.generate(generate_call, request), tm.abort_request)
    model = _model_name(tm)
    if call.stream:
        outputs, refused = await refused_stream(tm, outputs, OPENAI_ERRORS)
        if refused is not None:
            return refused
        return StreamingResponse(stream_chunks(call, outputs, model), media_type="text/event-stream")
    try:
        results = [out async for out in outputs]
    except (ValueError, ServiceUnavailableError) as error:
        return OPENAI_ERRORS.of(error)
    if len(results) < call.choices:  # the client went away; nobody reads this
        return OPENAI_ERRORS.response(400, "the client disconnected")
    refusals = [r for r in map(queue_refusal, results) if r is not None]
    if refusals:  # one response for all the choices: none can be given
        return OPENAI_ERRORS.busy(refusals[0])
    return JSONResponse(full_response(call, results, model))


def _model_card(tm: TokenizerManager) -> dict[str, Any]:
    return {
        "id": _model_name(tm),
        "object": "model",
        "created": 0,
        "owned_by": "srt",
        "root": tm.model_info["model_path"],
    }


def _adapter_cards(tm: TokenizerManager) -> list[dict[str, Any]]:
    """The LoRA adapters, as vLLM lists them: by name, their folder as root, the base as parent."""
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "srt",
            "root": path,
            "parent": _model_name(tm),
        }
        for name, path in (tm.lora_names or {}).items()
    ]


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    tm = manager(request)
    return JSONResponse({"object": "list", "data": [_model_card(tm), *_adapter_cards(tm)]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    """The served model by its id (the SDK's models.retrieve), else OpenAI's 404 for a model that
    does not exist (an id may hold slashes: a path served under its own name)."""
    tm = manager(request)
    card = _model_card(tm)
    card = next((c for c in _adapter_cards(tm) if c["id"] == model_id), card)
    if model_id != card["id"]:
        message = f"The model `{model_id}` does not exist; this server serves `{card['id']}`"
        body = openai_error_body(404, message, "model", "model_not_found")
        return JSONResponse(body, status_code=404)
    return JSONResponse(card)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)
