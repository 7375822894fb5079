"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A Responses request is read into the typed chat request (responses_parse.py) and runs as one; the
reply (the typed srt/conversation/reply.py: content, the <think> part, parsed tool calls) goes out
as a Response's output items, in this order: a `reasoning` item (what --reasoning-parser split off),
a `message` item with one `output_text` part, one `function_call` item per parsed call. `status` is
`completed`, or `incomplete` (reason max_output_tokens) when the output hit its limit. A stream
sends OpenAI's events, each with its sequence_number: `response.created`, `response.in_progress`,
per item `response.output_item.added`, its content (`response.content_part.added`,
`response.output_text.delta` / `.done`, `response.content_part.done`; or
`response.reasoning_text.delta` / `.done`; or `response.function_call_arguments.delta` / `.done`: a
call streams whole once it is complete) and `response.output_item.done`, then `response.completed`
(or `response.incomplete`) with the whole response. A request aborted while running is an error, not
a response: a 500 (or the abort's status), or in a stream an `error` event. Responses with `store`
(OpenAI's default) are kept in the front end (responses_store.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.conversation.reply import Usage
from srt.http_common import (
    OPENAI_ERRORS,
    Aborted,
    error_status,
    finish_of,
    manager,
    openai_error_body,
    read_json_object,
    refused_stream,
    sole_output,
)
from srt.repeated_calls import end_at_repeated_call
from srt.request_state import ServiceUnavailableError
from srt.responses_output import OutputItems, new_id
from srt.responses_parse import ResponsesCall, count_input_tokens, parse_responses
from srt.responses_store import ResponseStore

router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    """The app's stored responses (create_app puts them in the app's state)."""
    store: ResponseStore = request.app.state.responses
    return store


def _usage(usage: Usage) -> dict[str, Any]:
    prompt, output = usage.prompt_tokens, usage.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _response(
    call: ResponsesCall,
    rid: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Response object: in progress while meta is None, else finished as `meta` says."""
    status, incomplete, usage = "in_progress", None, None
    if meta is not None:
        usage = _usage(Usage.of(meta))
        status = "completed"
        if meta["finish_reason"]["type"] == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage,
        **call.echo,
    }


def response(
    call: ResponsesCall, out: dict[str, Any], model: str, rid: str, created_at: int
) -> dict[str, Any]:
    """The whole response to a finished output."""
    finish = finish_of(out)
    assert finish is not None
    items = OutputItems()
    items.add(call.chat.reply_reader().read(out, whole=True))
    status = "incomplete" if finish["type"] == "length" else "completed"
    items.close(status)
    return _response(call, rid, created_at, model, items.items, out["meta_info"])


async def _events(
    call: ResponsesCall,
    outputs: AsyncGenerator[dict[str, Any], None],
    model: str,
    rid: str,
    created_at: int,
    store: ResponseStore,
) -> AsyncGenerator[dict[str, Any], None]:
    reader, items = call.chat.reply_reader(), OutputItems()
    started = False
    async for out in outputs:
        if not started:
            start = _response(call, rid, created_at, model, [], None)
            yield {"type": "response.created", "response": start}
            yield {"type": "response.in_progress", "response": start}
            started = True
        finish = finish_of(out)
        for event in items.add(reader.read(out, whole=False)):
            yield event
        if finish is not None:
            for event in items.close("incomplete" if finish["type"] == "length" else "completed"):
                yield event
            whole = _response(call, rid, created_at, model, items.items, out["meta_info"])
            if whole["store"]:
                store.put(whole, call.items)
            kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
            yield {"type": kind, "response": whole}


def _sse(event: dict[str, Any], sequence_number: int) -> bytes:
    data = orjson.dumps({**event, "sequence_number": sequence_number})
    return b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n"


def _error_event(status: int, message: str) -> dict[str, Any]:
    error = openai_error_body(status, message)["error"]
    return {"type": "error", "code": error["type"], "message": message, "param": None}


async def stream_events(
    call: ResponsesCall,
    outputs: AsyncGenerator[dict[str, Any], None],
    model: str,
    store: ResponseStore,
) -> AsyncIterator[bytes]:
    """The response's events; an error midway ends the stream with an `error` event. A disconnect
    closes this generator, which closes `outputs` (aborting the request)."""
    events = _events(call, outputs, model, new_id("resp"), int(time.time()), store)
    sequence_number = 0
    async with aclosing(outputs), aclosing(events):
        try:
            async for event in events:
                yield _sse(event, sequence_number)
                sequence_number += 1
        except (Aborted, ServiceUnavailableError, ValueError) as error:
            yield _sse(_error_event(error_status(error), str(error)), sequence_number)


def _not_found(response_id: str, param: str | None = None) -> JSONResponse:
    return OPENAI_ERRORS.response(404, f"no stored response with id {response_id!r}", param)


def _history(store: ResponseStore, body: dict[str, Any]) -> list[dict[str, Any]] | JSONResponse:
    """The stored conversation a body's previous_response_id continues ([] without one), or the 404."""
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    stored = store.get(previous) if isinstance(previous, str) else None
    if stored is None:
        return _not_found(str(previous), "previous_response_id")
    return stored.conversation


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    tm, store = manager(request), store_of(request)
    renamed: dict[str, str] = {}
    try:
        tm.check_kind(embed=False)
        body = await read_json_object(request)
        history = _history(store, body)
        if isinstance(history, JSONResponse):
            return history
        call = parse_responses(tm, body, history)
        renamed = call.chat.renamed
        generate_call = tm.parse_generate(call.chat.generate_body)
    except (ValueError, ServiceUnavailableError) as error:
        return OPENAI_ERRORS.of(error, renamed)
    outputs = end_at_repeated_call(call.chat, tm.generate(generate_call, request), tm.abort_request)
    model = tm.server_args.model_name
    if call.chat.stream:
        outputs, refused = await refused_stream(tm, outputs, OPENAI_ERRORS)
        if refused is not None:
            return refused
        return StreamingResponse(stream_events(call, outputs, model, store), media_type="text/event-stream")
    out = await sole_output(outputs, OPENAI_ERRORS)
    if isinstance(out, JSONResponse):
        return out
    whole = response(call, out, model, new_id("resp"), int(time.time()))
    if whole["store"]:
        store.put(whole, call.items)
    return JSONResponse(whole)


@router.post("/v1/responses/input_tokens")
async def input_tokens(request: Request) -> Response:
    """The official client's `responses.input_tokens.count`: the tokens a request's prompt takes."""
    tm, store = manager(request), store_of(request)
    try:
        tm.check_kind(embed=False)
        body = await read_json_object(request)
        history = _history(store, body)
        if isinstance(history, JSONResponse):
            return history
        count = count_input_tokens(tm, body, history)
    except ValueError as error:
        return OPENAI_ERRORS.of(error)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    stored = store_of(request).get(response_id)
    return _not_found(response_id) if stored is None else JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    if not store_of(request).delete(response_id):
        return _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
