"""POST /tokenize and /detokenize (also under /v1), SGLang's (and vLLM's) shapes:

    /tokenize    {"prompt": str | [str, ...], "add_special_tokens": true}
                 -> {"tokens": [ids] | [[ids], ...], "count": n | [n, ...], "max_model_len": context length}
    /detokenize  {"tokens": [ids] | [[ids], ...], "skip_special_tokens": true}
                 -> {"text": str | [str, ...]}

The front end's own tokenizer answers; nothing reaches the ranks. Bad input is a 400 naming the
parameter, in /generate's error body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.generate_parse import RequestError
from srt.http_common import NATIVE_ERRORS, manager, read_json_object
from srt.openai_parse import reject_unknown
from srt.tokenizer_manager import TokenizerManager

router = APIRouter()

TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens"}
DETOKENIZE_FIELDS = {"model", "tokens", "skip_special_tokens"}


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, True)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", name)
    return value


def tokenize(tm: TokenizerManager, body: dict[str, Any]) -> dict[str, Any]:
    reject_unknown(body, TOKENIZE_FIELDS)
    prompt, special = body.get("prompt"), _flag(body, "add_special_tokens")
    if isinstance(prompt, str):
        ids = list(tm.tokenizer.encode(prompt, add_special_tokens=special))
        return {"tokens": ids, "count": len(ids), "max_model_len": tm.context_length}
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        lists = [list(tm.tokenizer.encode(p, add_special_tokens=special)) for p in prompt]
        return {"tokens": lists, "count": [len(ids) for ids in lists], "max_model_len": tm.context_length}
    raise RequestError(
        f"prompt must be a string or a non-empty list of strings, got {prompt!r}"[:200], "prompt"
    )


def detokenize(tm: TokenizerManager, body: dict[str, Any]) -> dict[str, Any]:
    reject_unknown(body, DETOKENIZE_FIELDS)
    tokens, skip = body.get("tokens"), _flag(body, "skip_special_tokens")

    def ids_ok(ids: Any) -> bool:
        return isinstance(ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tm.vocab_size for t in ids
        )

    if isinstance(tokens, list) and ids_ok(tokens):
        return {"text": tm.tokenizer.decode(tokens, skip_special_tokens=skip)}
    if isinstance(tokens, list) and tokens and all(ids_ok(ids) for ids in tokens):
        return {"text": [tm.tokenizer.decode(ids, skip_special_tokens=skip) for ids in tokens]}
    raise RequestError(
        f"tokens must be a list of token ids in [0, {tm.vocab_size}) or a list of such lists", "tokens"
    )


async def _answer(
    request: Request, handler: Callable[[TokenizerManager, dict[str, Any]], dict[str, Any]]
) -> Response:
    try:
        return JSONResponse(handler(manager(request), await read_json_object(request)))
    except ValueError as error:
        return NATIVE_ERRORS.of(error)


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize_route(request: Request) -> Response:
    return await _answer(request, tokenize)


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize_route(request: Request) -> Response:
    return await _answer(request, detokenize)
