"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A Messages request is read into the typed chat request (anthropic_parse.py) and runs as one; the
reply (the typed srt/conversation/reply.py: content, the <think> part, parsed tool calls) goes out
in Anthropic's blocks: `thinking`, `text`, `tool_use` (its id minted here) in that order. A stream
sends Anthropic's events: `message_start`, then per block `content_block_start`, its deltas
(`thinking_delta`, `text_delta`, `input_json_delta`: a tool call streams whole once it is complete)
and `content_block_stop`, then `message_delta` with the stop_reason and usage, and `message_stop`.
stop_reason is `end_turn`, `max_tokens`, `stop_sequence` (with the stop_sequence matched) or
`tool_use`. A request aborted while running (/abort_request, a failed rank) is an error, not a
message: an `api_error` response, or in a stream an `error` event. Errors use Anthropic's shape
(http_common.anthropic_error_body), and `--api-key` is also accepted in the `x-api-key` header the
official client sends (guard.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.anthropic_parse import count_tokens, parse_messages
from srt.conversation.call import ChatCall
from srt.conversation.reply import Reply, Usage
from srt.http_common import (
    ANTHROPIC_ERRORS,
    Aborted,
    error_status,
    finish_of,
    manager,
    read_json_object,
    refused_stream,
    sole_output,
)
from srt.repeated_calls import end_at_repeated_call
from srt.request_state import ServiceUnavailableError
from srt.tool_calls import ToolCall

router = APIRouter()


def _usage(usage: Usage) -> dict[str, Any]:
    """Anthropic counts the cached part of the prompt apart from input_tokens."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def _stop(reply: Reply) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if reply.finish_reason == "tool_calls":
        return "tool_use", None
    if reply.finish_reason == "length":
        return "max_tokens", None
    if reply.stop is not None:  # a stop string is one of the request's stop_sequences
        return "stop_sequence", reply.stop
    return "end_turn", None


def _tool_use(call: ToolCall) -> dict[str, Any]:
    arguments = call.parsed_arguments
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": call.name,
        "input": arguments if isinstance(arguments, dict) else {},
    }


def _envelope(rid: str, model: str) -> dict[str, Any]:
    return {"id": "msg_" + rid, "type": "message", "role": "assistant", "model": model}


def message(call: ChatCall, out: dict[str, Any], model: str) -> dict[str, Any]:
    """The whole reply to a finished output."""
    finish_of(out)
    reply = call.reply_reader().read(out, whole=True)
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content.extend(_tool_use(c) for c in reply.tool_calls)
    meta = out["meta_info"]
    stop_reason, stop_sequence = _stop(reply)
    return {
        **_envelope(meta["id"], model),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(Usage.of(meta)),
    }


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


@dataclass
class _Blocks:
    """The stream's content blocks: the one open now, and how many were started."""

    started: int = 0
    open: str | None = None  # "thinking" | "text" while one is open

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.started - 1})]

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        out.append(event("content_block_start", {"index": self.started, "content_block": block}))
        self.started += 1
        self.open = block["type"]
        return out

    def delta(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        """A thinking or text delta, in the open block of its kind (a new one if another is open)."""
        out = []
        if self.open != kind:
            empty = {"type": kind, kind: ""}
            out = self.start({**empty, "signature": ""} if kind == "thinking" else empty)
        out.append(event("content_block_delta", {"index": self.started - 1, "delta": delta}))
        return out

    def tool_use(self, call: ToolCall) -> list[bytes]:
        """A complete tool call: its block started empty, its input as one input_json_delta."""
        block = _tool_use(call)
        out = self.start({**block, "input": {}})
        arguments = orjson.dumps(block["input"]).decode()
        delta = {"type": "input_json_delta", "partial_json": arguments}
        out.append(event("content_block_delta", {"index": self.started - 1, "delta": delta}))
        return [*out, *self.close()]


async def _events(
    call: ChatCall, outputs: AsyncGenerator[dict[str, Any], None], model: str
) -> AsyncGenerator[bytes, None]:
    reader, blocks, started = call.reply_reader(), _Blocks(), False
    async for out in outputs:
        meta = out["meta_info"]
        if not started:
            usage = {**_usage(Usage.of(meta)), "output_tokens": 0}
            start = {
                **_envelope(meta["id"], model),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
            }
            yield event("message_start", {"message": {**start, "usage": usage}})
            started = True
        finish = finish_of(out)
        reply = reader.read(out, whole=False)
        parts = []
        if reply.reasoning:
            parts += blocks.delta("thinking", {"type": "thinking_delta", "thinking": reply.reasoning})
        if reply.content:
            parts += blocks.delta("text", {"type": "text_delta", "text": reply.content})
        for tool_call in reply.tool_calls:
            parts += blocks.tool_use(tool_call)
        for part in parts:
            yield part
        if finish is not None:
            for part in blocks.close():
                yield part
            stop_reason, stop_sequence = _stop(reply)
            yield event(
                "message_delta",
                {
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": meta["completion_tokens"]},
                },
            )
            yield event("message_stop", {})


def _error_event(status: int, message: str) -> bytes:
    body = ANTHROPIC_ERRORS.body(status, message, None)
    return event("error", {"error": body["error"]})


async def stream_events(
    call: ChatCall, outputs: AsyncGenerator[dict[str, Any], None], model: str
) -> AsyncIterator[bytes]:
    """The reply's events; an error midway ends the stream with an `error` event. A disconnect
    closes this generator, which closes `outputs` (aborting the request)."""
    events = _events(call, outputs, model)
    async with aclosing(outputs), aclosing(events):
        try:
            async for part in events:
                yield part
        except (Aborted, ServiceUnavailableError, ValueError) as error:
            yield _error_event(error_status(error), str(error))


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    tm = manager(request)
    renamed: dict[str, str] = {}
    try:
        tm.check_kind(embed=False)
        body = await read_json_object(request)
        call = parse_messages(tm, body)
        renamed = call.renamed
        generate_call = tm.parse_generate(call.generate_body)
    except (ValueError, ServiceUnavailableError) as error:
        return ANTHROPIC_ERRORS.of(error, renamed)
    outputs = end_at_repeated_call(call, tm.generate(generate_call, request), tm.abort_request)
    model = tm.server_args.model_name
    if call.stream:
        outputs, refused = await refused_stream(tm, outputs, ANTHROPIC_ERRORS)
        if refused is not None:
            return refused
        return StreamingResponse(stream_events(call, outputs, model), media_type="text/event-stream")
    out = await sole_output(outputs, ANTHROPIC_ERRORS)
    return out if isinstance(out, JSONResponse) else JSONResponse(message(call, out, model))


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(request: Request) -> Response:
    tm = manager(request)
    try:
        body = await read_json_object(request)
        return JSONResponse({"input_tokens": count_tokens(tm, body)})
    except ValueError as error:
        return ANTHROPIC_ERRORS.of(error)
