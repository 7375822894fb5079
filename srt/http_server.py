"""The HTTP app: native /generate (JSON or SSE), health, info and control routes.

Errors are JSON `{"error": {"message", "type", "code"[, "param"]}}`: 400 BadRequestError for bad
input (before anything reaches a rank), 503 ServiceUnavailable once a rank has died or a control
reply did not come. A stream that fails midway sends `data: {"error": ...}` and then `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.tokenizer_manager import RequestError, ServiceUnavailableError, TokenizerManager


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "code": status}
    if status == 400:
        error.update(type="BadRequestError", param=param)
    else:
        error["type"] = "ServiceUnavailable" if status == 503 else "InternalServerError"
    return {"error": error}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def bad_request(error: ValueError) -> JSONResponse:
    return error_response(400, str(error), getattr(error, "param", None))


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; RequestError naming the problem otherwise."""
    body = await request.body()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(f"the request body is not valid UTF-8 (bad byte at offset {error.start})") from None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_stream(outputs: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    async with aclosing(outputs):  # a disconnect closes this generator; close (and abort) the requests too
        try:
            async for out in outputs:
                yield sse(out)
        except ValueError as error:
            yield sse(error_body(400, str(error), getattr(error, "param", None)))
        except ServiceUnavailableError as error:
            yield sse(error_body(503, str(error)))
    yield "data: [DONE]\n\n"


def create_app(tokenizer_manager: TokenizerManager, server_info: dict[str, Any]) -> FastAPI:
    tm = tokenizer_manager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield
        await tm.close()

    app = FastAPI(title="srt", lifespan=lifespan)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            call = tm.parse_generate(await read_json_object(request))
        except ValueError as error:
            return bad_request(error)
        except ServiceUnavailableError as error:
            return error_response(503, str(error))
        outputs = tm.generate(call, request)
        if call.stream:
            return StreamingResponse(sse_stream(outputs), media_type="text/event-stream")
        try:
            results = [out async for out in outputs]
        except ValueError as error:
            return bad_request(error)
        except ServiceUnavailableError as error:
            return error_response(503, str(error))
        if len(results) < len(call.reqs):  # the client went away; nobody reads this
            return error_response(400, "the client disconnected")
        if not call.is_batch:
            return JSONResponse(results[0])
        return JSONResponse(sorted(results, key=lambda out: out["index"]))

    @app.get("/health")
    async def health() -> Response:
        if tm.failure is not None:
            return error_response(503, tm.failure)
        return JSONResponse({})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            await tm.health_generate()
        except ServiceUnavailableError as error:
            return error_response(503, str(error))
        return JSONResponse({})

    @app.get("/model_info")
    async def model_info() -> Response:
        model_path = tm.model_info["model_path"]
        return JSONResponse({"model_path": model_path, "tokenizer_path": tm.tokenizer_path, "is_generation": True,
                             "served_model_name": tm.server_args.served_model_name or model_path})

    @app.get("/server_info")
    async def server_info_route() -> Response:
        try:
            state = await tm.get_internal_state()
        except ServiceUnavailableError as error:
            return error_response(503, str(error))
        return JSONResponse({**server_info, "internal_states": [state]})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        try:
            reply = await tm.flush_cache()
        except ServiceUnavailableError as error:
            return error_response(503, str(error))
        if not reply.success:
            return error_response(400, str(reply.payload.get("message", "the cache was not flushed")))
        return JSONResponse({"success": True, **reply.payload})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            body = await read_json_object(request)
            rid = body.get("rid")
            if not isinstance(rid, str) or not rid:
                raise RequestError(f"rid must be a non-empty string, got {rid!r}", "rid")
        except ValueError as error:
            return bad_request(error)
        in_flight = await tm.abort_request(rid)
        return JSONResponse({"rid": rid, "in_flight": in_flight})

    return app


def run_http_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve until shut down; blocks (call it from the main thread to get uvicorn's signal handling)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="asyncio", timeout_keep_alive=5)
    uvicorn.Server(config).run()
