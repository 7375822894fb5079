"""What the route modules (native_api.py, openai_api.py, tokenize_api.py) and the guard share: the
app's TokenizerManager, the JSON body, the two error shapes, refusals before the first token, and
server-sent events.

Each API family words every error through one function:

    native (SGLang's /generate and friends)   {"error": {"message", "code": status, "type"[, "param"]}}
    OpenAI (/v1, and the guard's 401 / 413)   {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages)                  {"type": "error", "error": {"type", "message"}}

An ErrorFamily turns that function into responses (400 for bad input, 503 when the server cannot
serve, with Retry-After where the condition passes by itself) and into a stream's error event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from srt.generate_parse import RequestError
from srt.request_state import ServiceUnavailableError
from srt.server_args import ServerArgs
from srt.tokenizer_manager import TokenizerManager

RETRY_AFTER_S = 1  # what a 503 for a full waiting queue or a passed deadline tells the client to wait
SSE_DONE = b"data: [DONE]\n\n"

ErrorBody = Callable[[int, str, str | None], dict[str, Any]]


def manager(request: Request) -> TokenizerManager:
    """The TokenizerManager serving this app (create_app puts it in the app's state)."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
    return tm


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


# ---- errors ----
def native_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """SGLang's native error: 400 BadRequestError (with param), 503 ServiceUnavailable."""
    error: dict[str, Any] = {"message": message, "code": status}
    if status == 400:
        error.update(type="BadRequestError", param=param)
    else:
        error["type"] = "ServiceUnavailable" if status == 503 else "InternalServerError"
    return {"error": error}


def openai_error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error: a client's mistake is an invalid_request_error, the rest the server's."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error, which has no param field: the message names the field instead."""
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


@dataclass(frozen=True)
class ErrorFamily:
    """One API family's error responses and stream events, every one built by `body`."""

    body: ErrorBody

    def response(
        self, status: int, message: str, param: str | None = None, retry_after: bool = False
    ) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if retry_after else None
        return JSONResponse(self.body(status, message, param), status_code=status, headers=headers)

    def busy(self, message: str) -> JSONResponse:
        """503 with Retry-After: a full waiting queue, a passed deadline."""
        return self.response(503, message, retry_after=True)

    def of(
        self, error: ValueError | ServiceUnavailableError, renamed: dict[str, str] | None = None
    ) -> JSONResponse:
        """400 for bad input, naming its parameter (under the client's name for it, `renamed`; the
        message starts with that name where it does not hold it); 503 when the server cannot
        serve, with Retry-After where the condition passes by itself."""
        if isinstance(error, ServiceUnavailableError):
            return self.response(503, str(error), retry_after=error.retry_after)
        param, message = getattr(error, "param", None), str(error)
        if renamed is not None and param:
            param = renamed.get(param, param)
            if param not in message:  # the message names the generate parameter
                message = f"{param}: {message}"
        return self.response(400, message, param)

    def event(self, error: ValueError | ServiceUnavailableError) -> bytes:
        """The error as a stream's event (the status went out with the stream's start)."""
        if isinstance(error, ServiceUnavailableError):
            return sse(self.body(503, str(error), None))
        return sse(self.body(400, str(error), getattr(error, "param", None)))


NATIVE_ERRORS = ErrorFamily(native_error_body)
OPENAI_ERRORS = ErrorFamily(openai_error_body)
ANTHROPIC_ERRORS = ErrorFamily(anthropic_error_body)


class Aborted(Exception):
    """A request ended by an abort while it ran (not a refusal before its first token): the
    Anthropic and Responses routes answer it as an error, not as a reply."""

    def __init__(self, finish: dict[str, Any]) -> None:
        super().__init__(f"the request was aborted: {finish.get('message', 'aborted')}")
        self.status = int(finish.get("status_code") or 500)


def finish_of(out: dict[str, Any]) -> dict[str, Any] | None:
    """An output's finish_reason (None while it runs); Aborted where the request was aborted."""
    finish: dict[str, Any] | None = out["meta_info"]["finish_reason"]
    if finish is not None and finish.get("type") == "abort":
        raise Aborted(finish)
    return finish


def error_status(error: Aborted | ServiceUnavailableError | ValueError) -> int:
    """The HTTP status an error midway through a stream stands for, in its error event."""
    if isinstance(error, Aborted):
        return error.status
    return 503 if isinstance(error, ServiceUnavailableError) else 400


# ---- refusals before the first token ----
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


async def refused_stream(
    tm: TokenizerManager, outputs: AsyncGenerator[dict[str, Any], None], errors: ErrorFamily
) -> tuple[AsyncGenerator[dict[str, Any], None], JSONResponse | None]:
    """A stream's outputs and, where its request was refused before its first token, the 503 to
    answer instead (peek_refusal, where refusals_possible)."""
    if not refusals_possible(tm.server_args):
        return outputs, None
    outputs, refusal = await peek_refusal(outputs)
    return outputs, None if refusal is None else errors.busy(refusal)


async def sole_output(
    outputs: AsyncGenerator[dict[str, Any], None], errors: ErrorFamily
) -> dict[str, Any] | JSONResponse:
    """The finished output of a request of one choice, not streamed; or the error to answer: the
    client went away (400), a refusal before its first token (503), an abort while it ran (its
    status), bad input or a server that cannot serve (ErrorFamily.of)."""
    try:
        results = [out async for out in outputs]
    except (ValueError, ServiceUnavailableError) as error:
        return errors.of(error)
    if not results:  # the client went away; nobody reads this
        return errors.response(400, "the client disconnected")
    refusal = queue_refusal(results[-1])
    if refusal is not None:
        return errors.busy(refusal)
    try:
        finish_of(results[-1])
    except Aborted as aborted:
        return errors.response(aborted.status, str(aborted))
    return results[-1]


async def batch_outputs(
    outputs: AsyncGenerator[dict[str, Any], None], errors: ErrorFamily, renamed: dict[str, str] | None = None
) -> list[dict[str, Any]] | JSONResponse:
    """The finished outputs of a batch not streamed (each request's one output), in input order;
    or the error to answer, as sole_output's: the client gone, a refusal, an abort (its status)."""
    try:
        results = sorted([out async for out in outputs], key=lambda out: int(out.get("index") or 0))
    except (ValueError, ServiceUnavailableError) as error:
        return errors.of(error, renamed)
    if not results:
        return errors.response(400, "the client disconnected")
    for out in results:
        refusal = queue_refusal(out)
        if refusal is not None:
            return errors.busy(refusal)
        try:
            finish_of(out)
        except Aborted as aborted:
            return errors.response(aborted.status, str(aborted))
    return results


def json_body(body: Any, status_code: int = 200) -> Response:
    """A JSON response encoded by orjson: the same values as JSONResponse's, in a fraction of the
    time for many floats (embeddings: docs/performance.md)."""
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json")


# ---- server-sent events ----
def sse(data: Any) -> bytes:
    """One server-sent event. orjson: a stream sends one of these per request per decode step."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def sse_stream(
    outputs: AsyncGenerator[dict[str, Any], None],
    events: AsyncGenerator[bytes, None],
    errors: ErrorFamily,
) -> AsyncIterator[bytes]:
    """The `events` made from `outputs`, then [DONE]; an error midway becomes one error event
    before it. A disconnect closes this generator, which closes `outputs` (aborting the requests)."""
    async with aclosing(outputs), aclosing(events):
        try:
            async for event in events:
                yield event
        except (ValueError, ServiceUnavailableError) as error:
            yield errors.event(error)
    yield SSE_DONE
