"""SGLang's native routes: POST /generate (JSON or SSE), health, model and server info, load, cache
flush, /abort_request, and GET /metrics (Prometheus text; its own router, included with
--enable-metrics only, so that without it /metrics is a 404 as in SGLang).

Errors are SGLang's native body (http_common.native_error_body): 400 BadRequestError for bad input
(before anything reaches a rank), 503 ServiceUnavailable once a rank has died or a control reply
did not come. A stream that fails midway sends `data: {"error": ...}` and then `data: [DONE]`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from srt.generate_parse import RequestError
from srt.http_common import (
    NATIVE_ERRORS,
    manager,
    peek_refusal,
    queue_refusal,
    read_json_object,
    refusals_possible,
    sse,
    sse_stream,
)
from srt.request_state import ServiceUnavailableError

router = APIRouter()
metrics_router = APIRouter()


@functools.cache
def _model_config(model_dir: str) -> dict[str, Any]:
    try:
        return dict(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


@router.post("/generate")
async def generate(request: Request) -> Response:
    tm = manager(request)
    try:
        call = tm.parse_generate(await read_json_object(request))
    except (ValueError, ServiceUnavailableError) as error:
        return NATIVE_ERRORS.of(error)
    outputs = tm.generate(call, request, incremental=tm.server_args.incremental_streaming_output)
    if call.stream:
        if refusals_possible(tm.server_args) and not call.is_batch:
            outputs, refusal = await peek_refusal(outputs)
            if refusal is not None:
                return NATIVE_ERRORS.busy(refusal)
        events = (sse(out) async for out in outputs)
        return StreamingResponse(sse_stream(outputs, events, NATIVE_ERRORS), media_type="text/event-stream")
    try:
        results = [out async for out in outputs]
    except (ValueError, ServiceUnavailableError) as error:
        return NATIVE_ERRORS.of(error)
    if len(results) < len(call.reqs):  # the client went away; nobody reads this
        return NATIVE_ERRORS.response(400, "the client disconnected")
    refusal = queue_refusal(results[0]) if not call.is_batch else None
    if refusal is not None:  # a batch's refused items keep their abort finish reasons instead
        return NATIVE_ERRORS.busy(refusal)
    if not call.is_batch:
        return JSONResponse(results[0])
    return JSONResponse(sorted(results, key=lambda out: out["index"]))


@router.get("/health")
async def health(request: Request) -> Response:
    unhealthy = manager(request).unhealthy  # a failure, a shutdown, or an engine restart under way
    if unhealthy is not None:
        return NATIVE_ERRORS.response(503, unhealthy)
    return JSONResponse({})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    try:
        await manager(request).health_generate()
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    return JSONResponse({})


@router.get("/model_info")
@router.get("/get_model_info")  # SGLang's older names, still in its docs
async def model_info(request: Request) -> Response:
    tm = manager(request)
    model_path = tm.model_info["model_path"]
    config = _model_config(model_path)
    return JSONResponse(
        {
            "model_path": model_path,
            "tokenizer_path": tm.tokenizer_path,
            "is_generation": True,
            "served_model_name": tm.server_args.model_name,
            "preferred_sampling_params": None,
            "weight_version": tm.weights.version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
        }
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info_route(request: Request) -> Response:
    tm = manager(request)
    try:
        state = await tm.get_internal_state()
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    server_info: dict[str, Any] = request.app.state.server_info
    return JSONResponse({**server_info, "internal_states": [state], "memory": tm.memory_report()})


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """What SGLang's router polls for its load-aware policies: one entry per data-parallel rank
    (an srt server is one)."""
    try:
        load = await manager(request).get_load()
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    return JSONResponse([{"dp_rank": 0, **load}])


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    try:
        reply = await manager(request).flush_cache()
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    if not reply.success:
        return NATIVE_ERRORS.response(400, str(reply.payload.get("message", "the cache was not flushed")))
    return JSONResponse({"success": True, **reply.payload})


@router.post("/hicache/storage-backend/clear")
async def clear_hicache_storage(request: Request) -> Response:
    """SGLang's: deletes the disk tier's files (--enable-hierarchical-cache); 400 without it."""
    if not manager(request).server_args.disk_tier_on:
        return NATIVE_ERRORS.response(
            400, "the hierarchical cache is off: start with --enable-hierarchical-cache"
        )
    try:
        reply = await manager(request).clear_hicache_storage()
    except ServiceUnavailableError as error:
        return NATIVE_ERRORS.of(error)
    return PlainTextResponse(
        "Hierarchical cache storage backend cleared.\n", status_code=200 if reply.success else 400
    )


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    try:
        body = await read_json_object(request)
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise RequestError(f"rid must be a non-empty string, got {rid!r}", "rid")
    except ValueError as error:
        return NATIVE_ERRORS.of(error)
    in_flight = await manager(request).abort_request(rid)
    return JSONResponse({"rid": rid, "in_flight": in_flight})


@metrics_router.get("/metrics")
async def metrics_route(request: Request) -> Response:
    metrics = manager(request).metrics
    assert metrics is not None  # create_app includes this router only with --enable-metrics
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)
