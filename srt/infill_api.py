"""POST /infill: llama.cpp's fill-in-the-middle route (its tools/server), which editors' code
completion plugins call. The body (srt/infill_parse.py) becomes a FIM prompt (srt/fim.py) that runs
as a /generate request; the reply has the shape of llama.cpp's /completion:

    {"index": 0, "content": str, "tokens": [ids], "stop": true, "model": str,
     "tokens_predicted": n, "tokens_evaluated": n, "generation_settings": {...}, "prompt": str,
     "has_new_line": bool, "truncated": false, "stop_type": "eos" | "word" | "limit",
     "stopping_word": str, "tokens_cached": n}

`stream: true` sends server-sent events of {"index", "content", "tokens", "stop": false,
"tokens_predicted", "tokens_evaluated"} with what is new, then the object above with content ""
and tokens [] (llama.cpp sends no [DONE]). `response_fields` keeps only the fields named ("a/b"
names a nested one), keyed by those names. srt returns no `timings`. A model without FIM tokens,
and bad input, get /generate's 400 naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.http_common import (
    NATIVE_ERRORS,
    Aborted,
    finish_of,
    json_body,
    manager,
    read_json_object,
    refused_stream,
    sole_output,
    sse,
)
from srt.infill_parse import RENAMED, InfillCall, parse_infill
from srt.request_state import ServiceUnavailableError
from srt.tokenizer_manager import TokenizerManager

router = APIRouter()


def _stop_type(finish: dict[str, Any]) -> tuple[str, str]:
    """llama.cpp's stop_type and stopping_word for srt's finish_reason."""
    if finish["type"] == "length":
        return "limit", ""
    matched = finish.get("matched")
    return ("word", matched) if isinstance(matched, str) else ("eos", "")


def _pick(reply: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: each path found in the reply, under its own name."""
    picked = {}
    for path in paths:
        value: Any = reply
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked


def final_reply(tm: TokenizerManager, call: InfillCall, out: dict[str, Any], text: str) -> dict[str, Any]:
    """The finished request's reply (`text`: what it generated; "" at the end of a stream)."""
    meta = out["meta_info"]
    stop_type, word = _stop_type(meta["finish_reason"])
    reply = {
        "index": 0,
        "content": "" if call.stream else out["text"],
        "tokens": [] if call.stream else out["output_ids"],
        "stop": True,
        "model": tm.server_args.model_name,
        "tokens_predicted": meta["completion_tokens"],
        "tokens_evaluated": meta["prompt_tokens"],
        "generation_settings": call.settings,
        "prompt": tm.tokenizer.decode(call.prompt_ids, skip_special_tokens=False),
        "has_new_line": "\n" in text,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": word,
        "tokens_cached": meta["prompt_tokens"] + meta["completion_tokens"],
    }
    return _pick(reply, call.response_fields) if call.response_fields else reply


def _partial(out: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    return {
        "index": 0,
        "content": out["text"],
        "tokens": out["output_ids"],
        "stop": False,
        "tokens_predicted": meta["completion_tokens"],
        "tokens_evaluated": meta["prompt_tokens"],
    }


async def _events(
    tm: TokenizerManager, call: InfillCall, outputs: AsyncGenerator[dict[str, Any], None]
) -> AsyncIterator[bytes]:
    """The stream's events (each output holds only what is new: generate's `incremental`); an
    error midway is one error event, which ends the stream."""
    text = ""
    async with aclosing(outputs):
        try:
            async for out in outputs:
                text += out["text"]
                finish = finish_of(out)
                if out["text"] or out["output_ids"]:
                    yield sse(_partial(out))
                if finish is not None:
                    yield sse(final_reply(tm, call, out, text))
        except Aborted as aborted:
            yield sse(NATIVE_ERRORS.body(aborted.status, str(aborted), None))
        except (ValueError, ServiceUnavailableError) as error:
            yield NATIVE_ERRORS.event(error)


@router.post("/infill")
async def infill(request: Request) -> Response:
    tm = manager(request)
    renamed = RENAMED
    try:
        tm.check_kind(embed=False)
        call = parse_infill(tm, await read_json_object(request))
        renamed = call.renamed
        generate_call = tm.parse_generate(call.generate_body)
    except (ValueError, ServiceUnavailableError) as error:
        return NATIVE_ERRORS.of(error, renamed)
    outputs = tm.generate(generate_call, request, incremental=call.stream)
    if call.stream:
        outputs, refused = await refused_stream(tm, outputs, NATIVE_ERRORS)
        if refused is not None:
            return refused
        return StreamingResponse(_events(tm, call, outputs), media_type="text/event-stream")
    out = await sole_output(outputs, NATIVE_ERRORS)
    if isinstance(out, JSONResponse):
        return out
    return json_body(final_reply(tm, call, out, out["text"]))
