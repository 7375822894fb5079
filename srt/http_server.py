"""The HTTP app: native /generate (JSON or SSE), health, info and control routes, and GET /metrics
(Prometheus text, with --enable-metrics).

Errors are JSON `{"error": {"message", "type", "code"[, "param"]}}`: 400 BadRequestError for bad
input (before anything reaches a rank), 503 ServiceUnavailable once a rank has died or a control
reply did not come. A stream that fails midway sends `data: {"error": ...}` and then `data: [DONE]`.

The OpenAI-compatible /v1 routes live in openai_api.py and are included here.

Graceful shutdown (DrainingServer): on SIGTERM/SIGINT new requests get 503 "server is shutting
down" (/health too; /model_info and /abort_request keep answering) while the requests in flight
finish, for up to --shutdown-timeout seconds; the rest are then failed with a 503.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.guard import BodyTooLarge, RequestGuard, too_large_body
from srt.server_args import ServerArgs
from srt.tokenizer_manager import SHUTTING_DOWN, RequestError, ServiceUnavailableError, TokenizerManager

logger = logging.getLogger("srt.http_server")

DRAIN_POLL_S = 0.05
CLOSE_GRACE_S = 5  # after the drain: the longest uvicorn waits for the last responses to be written


@functools.cache
def _model_config(model_dir: str) -> dict[str, Any]:
    try:
        return dict(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "code": status}
    if status == 400:
        error.update(type="BadRequestError", param=param)
    else:
        error["type"] = "ServiceUnavailable" if status == 503 else "InternalServerError"
    return {"error": error}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


RETRY_AFTER_S = 1  # what a 503 for a full waiting queue or a passed deadline tells the client to wait


def queue_refusal(out: dict[str, Any]) -> str | None:
    """The message of an output refused with 503: the waiting queue was full, or a deadline passed."""
    finish = out["meta_info"]["finish_reason"]
    if finish is not None and finish.get("type") == "abort" and finish.get("status_code") == 503:
        return str(finish.get("message", "the server is busy"))
    return None


def refusals_possible(args: ServerArgs) -> bool:
    """Whether a request may be refused before its first token (a full queue, a waiting deadline): a
    stream then waits for its first output before answering, so a refusal is a 503, not an event."""
    return args.max_queued_requests is not None or args.req_waiting_timeout is not None


def busy_response(message: str, body: Callable[[int, str], dict[str, Any]] = error_body) -> JSONResponse:
    return JSONResponse(body(503, message), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable_response(
    error: ServiceUnavailableError, body: Callable[[int, str], dict[str, Any]] = error_body
) -> JSONResponse:
    """503; with Retry-After where the condition passes by itself."""
    return (
        busy_response(str(error), body)
        if error.retry_after
        else JSONResponse(body(503, str(error)), status_code=503)
    )


async def peek_refusal(
    outputs: AsyncGenerator[dict[str, Any], None],
) -> tuple[AsyncGenerator[dict[str, Any], None], str | None]:
    """For a stream that may be refused (refusals_possible): wait for its first output, so that a
    refused request gets a real 503 instead of a 200 stream with an error event. Returns the outputs
    again (the first one included) and the refusal, if any."""
    try:
        first = await outputs.__anext__()
    except StopAsyncIteration:
        first = None
    refusal = queue_refusal(first) if first is not None else None
    if refusal is not None:
        await outputs.aclose()  # aborts what else the call sent (other choices)

    async def again() -> AsyncGenerator[dict[str, Any], None]:
        async with aclosing(outputs):
            if first is not None:
                yield first
            async for out in outputs:
                yield out

    return again(), refusal


def bad_request(error: ValueError) -> JSONResponse:
    return error_response(400, str(error), getattr(error, "param", None))


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; RequestError naming the problem otherwise."""
    body = await request.body()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(
            f"the request body is not valid UTF-8 (bad byte at offset {error.start})"
        ) from None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


def sse(data: Any) -> bytes:
    """One server-sent event. orjson: a stream sends one of these per request per decode step."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def sse_stream(outputs: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    async with aclosing(outputs):  # a disconnect closes this generator; close (and abort) the requests too
        try:
            async for out in outputs:
                yield sse(out)
        except ValueError as error:
            yield sse(error_body(400, str(error), getattr(error, "param", None)))
        except ServiceUnavailableError as error:
            yield sse(error_body(503, str(error)))
    yield b"data: [DONE]\n\n"


def create_app(tokenizer_manager: TokenizerManager, server_info: dict[str, Any]) -> FastAPI:
    tm = tokenizer_manager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield
        await tm.close()

    from srt.openai_api import router as openai_router  # here: these import this module's helpers
    from srt.tokenize_api import router as tokenize_router

    app = FastAPI(title="srt", lifespan=lifespan)
    app.state.tokenizer_manager = tm  # for run_http_server's drain and the OpenAI routes
    args = tm.server_args
    app.add_middleware(
        RequestGuard,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_body_bytes=args.max_request_bytes,
    )

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, error: BodyTooLarge) -> Response:
        return JSONResponse(too_large_body(error.cap), status_code=413)

    app.include_router(openai_router)
    app.include_router(tokenize_router)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            call = tm.parse_generate(await read_json_object(request))
        except ValueError as error:
            return bad_request(error)
        except ServiceUnavailableError as error:
            return unavailable_response(error)
        outputs = tm.generate(call, request, incremental=tm.server_args.incremental_streaming_output)
        if call.stream:
            if refusals_possible(tm.server_args) and not call.is_batch:
                outputs, refusal = await peek_refusal(outputs)
                if refusal is not None:
                    return busy_response(refusal)
            return StreamingResponse(sse_stream(outputs), media_type="text/event-stream")
        try:
            results = [out async for out in outputs]
        except ValueError as error:
            return bad_request(error)
        except ServiceUnavailableError as error:
            return unavailable_response(error)
        if len(results) < len(call.reqs):  # the client went away; nobody reads this
            return error_response(400, "the client disconnected")
        refusal = queue_refusal(results[0]) if not call.is_batch else None
        if refusal is not None:  # a batch's refused items keep their abort finish reasons instead
            return busy_response(refusal)
        if not call.is_batch:
            return JSONResponse(results[0])
        return JSONResponse(sorted(results, key=lambda out: out["index"]))

    @app.get("/health")
    async def health() -> Response:
        if tm.unhealthy is not None:  # a failure, a shutdown, or an engine restart under way
            return error_response(503, tm.unhealthy)
        return JSONResponse({})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            await tm.health_generate()
        except ServiceUnavailableError as error:
            return unavailable_response(error)
        return JSONResponse({})

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older names, still in its docs
    async def model_info() -> Response:
        model_path = tm.model_info["model_path"]
        config = _model_config(model_path)
        return JSONResponse(
            {
                "model_path": model_path,
                "tokenizer_path": tm.tokenizer_path,
                "is_generation": True,
                "served_model_name": tm.server_args.model_name,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.get("model_type"),
                "architectures": config.get("architectures"),
            }
        )

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info_route() -> Response:
        try:
            state = await tm.get_internal_state()
        except ServiceUnavailableError as error:
            return unavailable_response(error)
        return JSONResponse({**server_info, "internal_states": [state], "memory": tm.memory_report()})

    @app.get("/get_load")
    async def get_load() -> Response:
        """What SGLang's router polls for its load-aware policies: one entry per data-parallel rank
        (an srt server is one)."""
        try:
            load = await tm.get_load()
        except ServiceUnavailableError as error:
            return unavailable_response(error)
        return JSONResponse([{"dp_rank": 0, **load}])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        try:
            reply = await tm.flush_cache()
        except ServiceUnavailableError as error:
            return unavailable_response(error)
        if not reply.success:
            return error_response(400, str(reply.payload.get("message", "the cache was not flushed")))
        return JSONResponse({"success": True, **reply.payload})

    if tm.metrics is not None:  # without --enable-metrics, /metrics is a 404 (as in SGLang)
        metrics = tm.metrics

        @app.get("/metrics")
        async def metrics_route() -> Response:
            body, content_type = metrics.render()
            return Response(body, media_type=content_type)

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


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT drains before it stops.

    The first signal makes the TokenizerManager refuse new requests (503) while the HTTP requests
    already running finish, for up to `drain_timeout` s; those still running then are failed with
    a 503 (a stream gets an SSE error event and [DONE]). A second signal ends the drain at once,
    the same way. Then uvicorn's own shutdown closes the listener and the connections and runs
    the lifespan's close. Unlike uvicorn's handler, this one does not re-raise the signal after
    serving: a requested shutdown simply returns from run().
    """

    def __init__(
        self, config: uvicorn.Config, tokenizer_manager: TokenizerManager, drain_timeout: float
    ) -> None:
        super().__init__(config)
        self.tm = tokenizer_manager
        self.drain_timeout = max(0.0, drain_timeout)
        self.signals_received = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler interrupts the loop anywhere: only set flags; the loop reads them.
        self.signals_received += 1
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.drain()
        await super().shutdown(sockets)

    async def drain(self) -> None:
        self.tm.begin_drain()
        in_flight = set(self.server_state.tasks)  # the requests running now; later ones get 503
        signals_at_start = self.signals_received
        logger.info(
            "%s: waiting up to %g s for %d request(s) in flight (signal again to stop at once)",
            SHUTTING_DOWN,
            self.drain_timeout,
            len(in_flight),
        )
        deadline = time.monotonic() + self.drain_timeout
        while True:
            in_flight = {task for task in in_flight if not task.done()}
            if not in_flight:
                logger.info("drained: no request in flight")
                return
            if self.signals_received > signals_at_start:
                reason = "a second shutdown signal arrived before the request finished"
                break
            if time.monotonic() >= deadline:
                reason = f"the request did not finish within --shutdown-timeout ({self.drain_timeout:g} s)"
                break
            await asyncio.sleep(DRAIN_POLL_S)
        logger.warning("%s: failing %d request(s) still in flight: %s", SHUTTING_DOWN, len(in_flight), reason)
        self.tm.fail_all(f"{SHUTTING_DOWN}: {reason}")


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """loop / http "auto": uvloop and httptools (dependencies; uvicorn falls back to asyncio and h11
    without them), which cost the front end less CPU than asyncio + h11 (docs/performance.md);
    log_config=None: uvicorn's lines go
    through the process's own handler, labelled like every other line."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        loop="auto",
        http="auto",
        timeout_keep_alive=5,
        timeout_graceful_shutdown=CLOSE_GRACE_S,
        log_config=None,
    )


def run_http_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT, drain (DrainingServer, --shutdown-timeout), return. Blocks; call
    it from the main thread, where signal handlers can be installed."""
    tm: TokenizerManager = app.state.tokenizer_manager
    DrainingServer(uvicorn_config(app, host, port, log_level), tm, tm.server_args.shutdown_timeout).run()
