"""Embeddings, on a server started with `--is-embedding`: OpenAI's POST /v1/embeddings and SGLang's
POST /encode.

Each input becomes a request asking for no new token: it goes through the same broadcast, scheduler
and batches as a generation, its prompt runs whole, and its final hidden states come back pooled
(model_executor/pooler.py). /v1/embeddings takes a string, a list of token ids or a batch of either,
`encoding_format` float or base64 (little-endian float32, as the official client decodes it) and
`dimensions` only at the model's own size (srt does not truncate: no model it serves was trained
for it). /encode takes /generate's `text` or `input_ids` (one or a batch) and answers
`{"embedding", "meta_info"}` per input, as SGLang's. A generating server answers both with a 400.

Fields: OpenAI's `embeddings.create` (openai 3.60) and SGLang's `EmbeddingRequest` and
`EmbeddingReqInput` (sglang 0.5.23), in srt/request_fields.py's kinds.
"""

from __future__ import annotations

import array
import base64
import logging
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.generate_parse import RequestError, check_request_fields, is_int
from srt.http_common import (
    NATIVE_ERRORS,
    OPENAI_ERRORS,
    ErrorFamily,
    batch_outputs,
    json_body,
    manager,
    read_json_object,
)
from srt.request_fields import NONE, Field, advisory, impl, off
from srt.request_state import ServiceUnavailableError
from srt.tokenizer_manager import TokenizerManager

logger = logging.getLogger("srt.embeddings_api")
router = APIRouter()

EMBEDDINGS: dict[str, Field] = {
    "input": impl(),
    "model": advisory("default"),
    "encoding_format": impl("float"),
    "dimensions": impl(),  # the model's own size only
    "user": advisory(),
    "rid": impl(),
    "priority": impl(),
    "lora_path": NONE,
    "embed_override_token_id": NONE,
    "embed_overrides": NONE,
}
ENCODE: dict[str, Field] = {
    "text": impl(),
    "input_ids": impl(),
    "rid": impl(),
    "priority": impl(),
    "log_metrics": impl(True),
    "sampling_params": off(None, {}),
    "input_embeds": NONE,
    "image_data": NONE,
    "video_data": NONE,
    "audio_data": NONE,
    "embed_override_token_id": NONE,
    "embed_overrides": NONE,
    "modalities": NONE,
    "is_cross_encoder_request": off(False),
    "lora_path": NONE,
    "model": advisory(),
}


def _inputs(value: Any) -> tuple[str, Any]:
    """(the /generate key, its value) of OpenAI's `input`: a string, token ids, or a batch of either."""
    if isinstance(value, str):
        return "text", value
    if isinstance(value, list) and value:
        if all(is_int(t) for t in value):
            return "input_ids", value
        if all(isinstance(t, str) for t in value):
            return "text", value
        if all(isinstance(t, list) and t and all(is_int(i) for i in t) for t in value):
            return "input_ids", value
    raise RequestError("input must be a string, a list of token ids, or a non-empty list of either", "input")


async def embed_outputs(
    tm: TokenizerManager, request: Request, body: dict[str, Any], errors: ErrorFamily, renamed: dict[str, str]
) -> list[dict[str, Any]] | JSONResponse:
    """The outputs of an embedding /generate body in input order, or the error to answer: a 500
    where an embedding is not finite (orjson would write its NaN as null)."""
    call = tm.parse_generate({**body, "sampling_params": {"max_new_tokens": 0}}, embed=True)
    outs = await batch_outputs(tm.generate(call, request), errors, renamed)
    bad = None if isinstance(outs, JSONResponse) else first_non_finite([out["embedding"] for out in outs])
    if bad is None:
        return outs
    message = f"the model's embedding of input {bad} is not finite (NaN or infinity)"
    logger.error(message)
    return errors.response(500, message)


def first_non_finite(embeddings: list[list[float]]) -> int | None:
    """The index of the first embedding holding a NaN or an infinity, or None. A NaN or an infinity
    makes the sum of the values NaN or infinite, so a finite sum clears an embedding in one C loop;
    a non-finite one (or an overflow of finite values) is looked at value by value."""
    for i, embedding in enumerate(embeddings):
        if not math.isfinite(sum(embedding)) and not all(map(math.isfinite, embedding)):
            return i
    return None


def _encoded(embedding: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return embedding
    return base64.b64encode(array.array("f", embedding).tobytes()).decode()  # float32, as OpenAI sends


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    tm = manager(request)
    renamed = {"text": "input", "input_ids": "input"}
    try:
        body = await read_json_object(request)
        check_request_fields(body, EMBEDDINGS)
        key, value = _inputs(body.get("input"))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise RequestError(f"encoding_format must be float or base64, got {fmt!r}", "encoding_format")
        size = int(tm.model_info.get("hidden_size", 0))
        dimensions = body.get("dimensions")
        if dimensions is not None and dimensions != size:
            raise RequestError(
                f"dimensions={dimensions!r}: this model's embeddings have {size} and srt does not truncate them",
                "dimensions",
            )
        fields = {name: body[name] for name in ("rid", "priority") if body.get(name) is not None}
        outs = await embed_outputs(tm, request, {key: value, **fields}, OPENAI_ERRORS, renamed)
    except (ValueError, ServiceUnavailableError) as error:
        return OPENAI_ERRORS.of(error, renamed)
    if isinstance(outs, JSONResponse):
        return outs
    prompt = sum(out["meta_info"]["prompt_tokens"] for out in outs)
    return json_body(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encoded(out["embedding"], fmt)}
                for i, out in enumerate(outs)
            ],
            "model": tm.server_args.model_name,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        }
    )


@router.post("/encode")
async def encode(request: Request) -> Response:
    tm = manager(request)
    try:
        body = await read_json_object(request)
        check_request_fields(body, ENCODE)
        body.pop("sampling_params", None)
        outs = await embed_outputs(tm, request, body, NATIVE_ERRORS, {})
    except (ValueError, ServiceUnavailableError) as error:
        return NATIVE_ERRORS.of(error)
    if isinstance(outs, JSONResponse):
        return outs
    replies = [{"embedding": out["embedding"], "meta_info": out["meta_info"]} for out in outs]
    batch = isinstance(body.get("text", body.get("input_ids")), list) and (
        isinstance(body.get("text"), list) or isinstance((body.get("input_ids") or [None])[0], list)
    )
    return json_body(replies if batch else replies[0])
