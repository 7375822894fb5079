"""SGLang's RL rollout routes, in its shapes: POST /update_weights_from_disk, /update_weight_version,
/pause_generation, /continue_generation (srt/weight_updates.py does the work; the ranks agree on an
update before it serves: scheduler/weight_registry.py). `weight_version` is in /model_info and in
every reply's meta_info.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.http_common import NATIVE_ERRORS, manager, read_json_object
from srt.request_state import ServiceUnavailableError

router = APIRouter()


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object sent; an empty body is {} (every field has its default)."""
    return await read_json_object(request) if (await request.body()).strip() else {}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    """{"model_path", "load_format"?, "abort_all_requests"?, "weight_version"?}: the running model's
    weights from a safetensors folder of the same config, on every rank or none. 200 or 400 with
    SGLang's {"success", "message", "num_paused_requests"}."""
    tm = manager(request)
    try:
        success, message, paused = await tm.weights.update_from_disk(await read_json_object(request))
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    except ValueError as error:
        success, message, paused = False, str(error), 0
    body = {"success": success, "message": message, "num_paused_requests": paused}
    return JSONResponse(body, status_code=200 if success else 400)


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    """{"new_version", "abort_all_requests"? (true)}: the version replies report from now on."""
    tm = manager(request)
    try:
        version = await tm.weights.update_version(await read_json_object(request))
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    except ValueError as error:
        message = f"Failed to update weight version: {error}"
        return JSONResponse({"success": False, "message": message}, status_code=400)
    body = {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
    return JSONResponse(body)


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    """{"mode"?: "abort" (default) | "retract" | "in_place"}; new requests wait until continue."""
    tm = manager(request)
    try:
        await tm.weights.pause(await _body(request))
    except (ValueError, ServiceUnavailableError) as error:
        return NATIVE_ERRORS.of(error)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    """Steps run again and held requests go; harmless without a pause."""
    tm = manager(request)
    try:
        await _body(request)  # SGLang's fields (torch_empty_cache) change nothing here
        await tm.weights.resume()
    except ValueError as error:
        return NATIVE_ERRORS.of(error)
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})
