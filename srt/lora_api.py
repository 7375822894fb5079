"""LoRA adapters loaded and unloaded while the server runs (--enable-lora): SGLang's POST
/load_lora_adapter and /unload_lora_adapter, vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, each answering in its server's shape.

A load reaches every rank through rank 0's broadcast; the adapter becomes usable (by /generate's
lora_path, OpenAI's model, /v1/models' list) only once every rank loaded its shard, and a failure
on any rank is a 400 naming the cause with the registry unchanged everywhere
(scheduler/lora_registry.py). An unload refuses the name to new requests at once and answers once
the requests running or queued under it have finished.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from srt.http_common import NATIVE_ERRORS, OPENAI_ERRORS, manager, read_json_object
from srt.request_state import ServiceUnavailableError
from srt.tokenizer_manager import TokenizerManager

router = APIRouter()

# a registry change: the manager's call with the request's body, its reply's payload
Change = Callable[[TokenizerManager, dict[str, Any]], Awaitable[dict[str, Any]]]


def _sglang_reply(payload: dict[str, Any], error: str | None = None) -> JSONResponse:
    """SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters (name -> folder)."""
    body = {
        "success": error is None,
        "error_message": error,
        "loaded_adapters": payload.get("loaded_adapters"),
    }
    return JSONResponse(body, status_code=200 if error is None else 400)


async def _sglang_call(request: Request, change: Change) -> Response:
    """One of SGLang's two routes: `change` with the manager and the body, answered in its shape
    (bad input or a refused change: 400 with success false; 503 while the server cannot serve)."""
    tm = manager(request)
    try:
        payload = await change(tm, await read_json_object(request))
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    except ValueError as error:
        return _sglang_reply({"loaded_adapters": tm.lora_names}, str(error))
    return _sglang_reply(payload)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """SGLang's: {"lora_name", "lora_path", "pinned"?} loads the peft folder as that adapter on every
    rank (a pinned one never leaves under --max-loaded-loras: srt/lora_residency.py)."""
    return await _sglang_call(
        request,
        lambda tm, body: tm.load_lora_adapter(
            body.get("lora_name"), body.get("lora_path"), body.get("pinned", False)
        ),
    )


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """SGLang's: {"lora_name"} unloads the adapter. New requests naming it are refused at once
    (400); the requests running or queued under it finish with it, unchanged, and only then does
    this call answer (it may take as long as they do)."""
    return await _sglang_call(request, lambda tm, body: tm.unload_lora_adapter(body.get("lora_name")))


@router.post("/v1/load_lora_adapter")
async def vllm_load_lora_adapter(request: Request) -> Response:
    """vLLM's: {"lora_name", "lora_path"}; 200 with vLLM's text, or OpenAI's error (400)."""
    tm = manager(request)
    try:
        body = await read_json_object(request)
        await tm.load_lora_adapter(body.get("lora_name"), body.get("lora_path"))
    except (ValueError, ServiceUnavailableError) as error:
        return OPENAI_ERRORS.of(error)
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def vllm_unload_lora_adapter(request: Request) -> Response:
    """vLLM's: {"lora_name"}; 404 for an adapter not loaded, as vLLM. Waits as /unload_lora_adapter
    does: new requests are refused at once, the call answers once the adapter's requests finished."""
    tm = manager(request)
    try:
        body = await read_json_object(request)
        name = body.get("lora_name")
        if tm.lora_names is not None and isinstance(name, str) and name not in tm.lora_names:
            return OPENAI_ERRORS.response(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        await tm.unload_lora_adapter(name)
    except (ValueError, ServiceUnavailableError) as error:
        return OPENAI_ERRORS.of(error)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
