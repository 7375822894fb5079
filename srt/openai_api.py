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
in SGLang); responses name the served model. finish_reason is "stop", "length", or "abort" for a
request ended by /abort_request.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code": null}}`
(http_common.openai_error_body): 400 for bad input, 503 when the server cannot serve; a stream
that fails midway sends the error as an event, then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
from srt.reasoning import ReasoningSplit
from srt.repeated_calls import end_at_repeated_call
from srt.request_state import ServiceUnavailableError
from srt.tokenizer_manager import TokenizerManager

router = APIRouter()


def _model_name(tm: TokenizerManager) -> str:
    return tm.server_args.model_name


def _usage(metas: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Usage of the choices (n per prompt, in order): each prompt counts once."""
    firsts = metas[::n]
    prompt = sum(meta["prompt_tokens"] for meta in firsts)
    completion = sum(meta["completion_tokens"] for meta in metas)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(meta["cached_tokens"] for meta in firsts)},
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
    """What one choice has sent so far (a stream sends only what is new)."""

    text: str = ""
    tokens: int = 0  # output tokens whose logprobs were sent
    text_offset: int = 0  # completions: where the next token's text starts
    first: bool = True
    reasoning: str = ""  # reasoning_content sent so far
    calls: int = 0  # tool calls sent so far


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


def chat_choice(
    call: OpenAICall, out: dict[str, Any], progress: ChoiceProgress, chunk: bool
) -> dict[str, Any]:
    """One choice of a response (chunk False) or what is new in it since `progress` (a stream's
    delta): its content, reasoning_content and tool_calls, and its finish_reason. The Anthropic
    routes shape theirs from it too."""
    meta = out["meta_info"]
    choice: dict[str, Any] = {
        "index": out.get("index", 0),
        "logprobs": _logprobs(call, meta, progress),
        "finish_reason": _finish_reason(meta),
    }
    reasoning = None
    if call.chat and call.reasoning is not None:  # the content part goes on as the whole output would
        out, reasoning = _reasoning_part(
            call.reasoning, out, progress, chunk, choice["finish_reason"] is not None
        )
    if call.tools is not None:
        choice = _tool_choice_part(call, out, progress, chunk, choice)
    else:
        choice = _content_part(call, out, progress, chunk, choice)
    if reasoning is not None:
        choice["delta" if chunk else "message"]["reasoning_content"] = reasoning
    return choice


def _reasoning_part(
    split: ReasoningSplit, out: dict[str, Any], progress: ChoiceProgress, chunk: bool, finished: bool
) -> tuple[dict[str, Any], str | None]:
    """(the output with only its content as text, the reasoning_content to send: all of it in a
    whole reply; in a stream what is new, or with stream_reasoning false all of it once it ended)."""
    reasoning, content, done = split.split(out["text"], finished)
    out = {**out, "text": content}
    if not chunk:
        return out, reasoning or None
    if not split.stream_reasoning and not done:
        return out, None
    new = reasoning[len(progress.reasoning) :] if reasoning.startswith(progress.reasoning) else ""
    progress.reasoning = max(reasoning, progress.reasoning, key=len)
    return out, new or None


def _content_part(
    call: OpenAICall, out: dict[str, Any], progress: ChoiceProgress, chunk: bool, choice: dict[str, Any]
) -> dict[str, Any]:
    delta = out["text"][len(progress.text) :]  # the text is cumulative; send what is new
    progress.text = out["text"]
    if call.echo is not None and progress.first:
        delta = call.echo[choice["index"] // call.n] + delta
    if not call.chat:
        choice["text"] = delta
    elif not chunk:
        choice["message"] = {"role": "assistant", "content": delta}
    else:
        choice["delta"] = {"role": "assistant", "content": delta} if progress.first else {"content": delta}
    progress.first = False
    return choice


def _tool_choice_part(
    call: OpenAICall, out: dict[str, Any], progress: ChoiceProgress, chunk: bool, choice: dict[str, Any]
) -> dict[str, Any]:
    """A chat choice whose output may hold tool calls: content streams only up to where a call
    could begin; the calls are parsed from the finished text (finish_reason tool_calls)."""
    assert call.tools is not None
    text, finished = out["text"], choice["finish_reason"] is not None
    message: dict[str, Any] = {"role": "assistant"} if progress.first or not chunk else {}
    if not finished:
        safe = text[: call.tools.stream_safe_prefix(text)]
        message["content"] = safe[len(progress.text) :] if len(safe) > len(progress.text) else ""
        progress.text = max(safe, progress.text, key=len)
        calls = call.tools.complete_calls(text) if chunk else []
    else:
        content, calls = call.tools.parse(text)
        rest = content or ""
        message["content"] = (
            (rest[len(progress.text) :] if rest.startswith(progress.text) else "") if chunk else content
        )
        if calls and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        if chunk and not message["content"] and calls:
            message["content"] = None
        progress.text = text
    if chunk and len(calls) > progress.calls:  # each call streams once, as soon as it is complete
        message["tool_calls"] = [c.to_json(i) for i, c in enumerate(calls) if i >= progress.calls]
        progress.calls = len(calls)
    elif calls and not chunk:
        message["tool_calls"] = [c.to_json() for c in calls]
    choice["delta" if chunk else "message"] = message
    progress.first = False
    return choice


def full_response(call: OpenAICall, outs: list[dict[str, Any]], model: str) -> dict[str, Any]:
    outs = sorted(outs, key=lambda out: out.get("index", 0))
    choices = [chat_choice(call, out, ChoiceProgress(), chunk=False) for out in outs]
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
        choice = chat_choice(call, out, progress.setdefault(index, ChoiceProgress()), chunk=True)
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


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(manager(request))]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    """The served model by its id (the SDK's models.retrieve), else OpenAI's 404 for a model that
    does not exist (an id may hold slashes: a path served under its own name)."""
    card = _model_card(manager(request))
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
