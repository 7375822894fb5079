"""The HTTP app (create_app) and its server (run_http_server).

The routes live beside this: SGLang's native routes in native_api.py, the OpenAI-compatible /v1
routes in openai_api.py, Anthropic's /v1/messages in anthropic_api.py, OpenAI's /v1/responses in responses_api.py,
/v1/embeddings and /encode in embeddings_api.py, llama.cpp's /infill in infill_api.py, SGLang's /v1/rerank in rerank_api.py and /v1/score in score_api.py, /tokenize and /detokenize in tokenize_api.py, what they share (the error
shapes, SSE) in http_common.py; the API keys and the body-size cap in guard.py, before every route.

Graceful shutdown (DrainingServer): on SIGTERM/SIGINT new requests get 503 "server is shutting
down" (/health too; /model_info and /abort_request keep answering) while the requests in flight
finish, for up to --shutdown-timeout seconds; the rest are then failed with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from srt.anthropic_api import router as anthropic_router
from srt.embeddings_api import router as embeddings_router
from srt.guard import BodyTooLarge, RequestGuard, too_large_body
from srt.infill_api import router as infill_router
from srt.lora_api import router as lora_router
from srt.native_api import metrics_router
from srt.native_api import router as native_router
from srt.openai_api import router as openai_router
from srt.rerank_api import router as rerank_router
from srt.responses_api import router as responses_router
from srt.responses_store import ResponseStore
from srt.score_api import router as score_router
from srt.tokenize_api import router as tokenize_router
from srt.tokenizer_manager import SHUTTING_DOWN, TokenizerManager
from srt.weights_api import router as weights_router

logger = logging.getLogger("srt.http_server")

DRAIN_POLL_S = 0.05
CLOSE_GRACE_S = 5  # after the drain: the longest uvicorn waits for the last responses to be written


def create_app(tokenizer_manager: TokenizerManager, server_info: dict[str, Any]) -> FastAPI:
    """The app serving `tokenizer_manager`: the guard before every route, then the native, OpenAI
    and tokenize routes (and /metrics with --enable-metrics)."""
    tm = tokenizer_manager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield
        await tm.close()

    app = FastAPI(title="srt", lifespan=lifespan)
    app.state.tokenizer_manager = tm  # http_common.manager, and run_http_server's drain
    app.state.server_info = server_info  # /server_info
    app.state.responses = ResponseStore(tm.server_args.responses_store_size)  # responses_api.store_of
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
    app.include_router(anthropic_router)
    app.include_router(embeddings_router)
    app.include_router(score_router)
    app.include_router(rerank_router)
    app.include_router(responses_router)
    app.include_router(tokenize_router)
    app.include_router(infill_router)
    app.include_router(native_router)
    app.include_router(lora_router)
    app.include_router(weights_router)
    if tm.metrics is not None:  # without --enable-metrics, /metrics is a 404 (as in SGLang)
        app.include_router(metrics_router)
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


def run_http_server(app: FastAPI, listener: socket.socket, log_level: str = "info") -> None:
    """Serve on `listener` (bound by the launcher before any child started: launcher.net) until
    SIGTERM/SIGINT, drain (DrainingServer, --shutdown-timeout), return. Blocks; call it from the
    main thread, where signal handlers can be installed."""
    tm: TokenizerManager = app.state.tokenizer_manager
    host, port = listener.getsockname()[:2]
    config = uvicorn_config(app, host, port, log_level)
    DrainingServer(config, tm, tm.server_args.shutdown_timeout).run(sockets=[listener])
