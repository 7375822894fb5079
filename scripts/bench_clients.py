"""The HTTP side of the serving benchmark: which API a server speaks, and one timed request on it.

Two backends, both greedy with `ignore_eos` so every request makes exactly its output length:
- `srt`: srt's native `POST /generate` with `input_ids`; each streamed chunk's
  `meta_info.completion_tokens` (else the length of its cumulative `output_ids`) gives the tokens
  so far, so the tokens per chunk are known exactly, with or without --incremental-streaming-output.
- `openai`: `POST /v1/completions` with a token-id `prompt` (vLLM, SGLang and srt accept one) and
  `stream_options.include_usage`. The tokens per chunk are not visible there: each chunk counts as
  one token for TTFT / ITL (as vLLM's and SGLang's benchmarks count them), and the output length is
  the final `usage.completion_tokens` when the server sends it, else the number of chunks.
`auto` picks `srt` when `GET /server_info` names a `vocab_size` (srt's front end does), else `openai`.

The timed requests go through aiohttp (`open_session`, one session per level), whose HTTP parser is
compiled: on a small machine the client's CPU is taken from the server it measures. The blocking
one-off calls of the benchmark scripts (health polls, warmups, /server_info) go through the standard
library (`http_call`). Neither reads proxy settings from the environment.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from bench_metrics import RequestResult

try:
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads  # raises orjson.JSONDecodeError, a json.JSONDecodeError
except ImportError:  # pragma: no cover  (orjson comes with the server package)
    _loads = json.loads

BACKENDS = ("auto", "srt", "openai")
# What a missing server or a broken connection raises, in the async client (aiohttp; its total
# timeout raises asyncio.TimeoutError) and in http_call (urllib: URLError, HTTPError and socket
# timeouts are OSErrors; a garbled answer is an http.client.HTTPException).
HTTP_ERRORS: tuple[type[Exception], ...] = (
    aiohttp.ClientError,
    asyncio.TimeoutError,
    OSError,
    http.client.HTTPException,
)


class BadAnswer(Exception):
    """The server answered 200 but the stream is not a complete, successful answer."""


@dataclass(frozen=True)
class Target:
    backend: str  # "srt" or "openai"
    base_url: str
    model: str | None = None  # the `model` field of OpenAI requests

    @property
    def url(self) -> str:
        return f"{self.base_url}/generate" if self.backend == "srt" else f"{self.base_url}/v1/completions"


# ---- blocking one-off calls ----
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxies from the environment


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


def http_call(url: str, timeout_s: float, json_body: Any = None) -> HttpAnswer:
    """GET `url`, or POST `json_body` as JSON when given; the answer whatever its status. Raises one of
    HTTP_ERRORS when the server cannot be reached, does not answer within `timeout_s`, or answers garbage."""
    data = None if json_body is None else json.dumps(json_body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method="GET" if data is None else "POST",
        headers={} if data is None else {"Content-Type": "application/json"},
    )
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return HttpAnswer(response.status, response.read())
    except urllib.error.HTTPError as error:  # a status other than 2xx: an answer all the same
        with error:
            return HttpAnswer(error.code, error.read())


# ---- the timed requests ----
def open_session(timeout_s: float, limit: int | None = None) -> aiohttp.ClientSession:
    """A session whose requests each time out after `timeout_s` (the whole request, the streamed body
    included) and which opens at most `limit` connections at a time (None: no limit). Call it in the
    event loop that uses it, as `async with open_session(...) as client`."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s), connector=aiohttp.TCPConnector(limit=limit or 0)
    )


async def _get_json(client: aiohttp.ClientSession, url: str) -> Any:
    """The JSON body of a 200 answer, else None (the route is missing or failing on this server)."""
    async with client.get(url) as response:
        if response.status != 200:
            return None
        body = await response.read()
    try:
        return _loads(body)
    except ValueError:
        return None


async def resolve_target(
    client: aiohttp.ClientSession, base_url: str, backend: str = "auto", model: str | None = None
) -> tuple[Target, int | None]:
    """The target to benchmark and the vocabulary size the server reports (None when it does not).

    Raises aiohttp.ClientError or asyncio.TimeoutError when the server cannot be reached, ValueError
    for an unknown backend or an OpenAI server that lists no model (pass `model` then)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    info = await _get_json(client, f"{base_url}/server_info")
    vocab_size = info.get("vocab_size") if isinstance(info, dict) else None
    vocab_size = vocab_size if isinstance(vocab_size, int) else None
    if backend == "auto":
        backend = "srt" if vocab_size is not None else "openai"
    if backend == "openai" and model is None:
        models = await _get_json(client, f"{base_url}/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise ValueError(f"{base_url}/v1/models lists no model; pass the model name")
        model = str(data[0]["id"])
    return Target(backend, base_url, model), vocab_size


def _payload(target: Target, input_ids: list[int], output_len: int, stream: bool) -> dict[str, Any]:
    if target.backend == "srt":
        return {
            "input_ids": input_ids,
            "stream": stream,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        }
    payload: dict[str, Any] = {
        "model": target.model,
        "prompt": input_ids,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


async def _lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The lines of a body that arrives in `chunks`, without their b"\\n", however long they are
    (aiohttp's own line reader refuses a line over 128 KiB; srt's chunks repeat every output id)."""
    pending = b""
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE stream; raises BadAnswer when it ends without `data: [DONE]`."""
    async for line in _lines(response.content.iter_any()):
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        yield _loads(data)
    raise BadAnswer("the stream ended without data: [DONE]")


def _stream_error(event: dict[str, Any]) -> str:
    error = event["error"]
    return f"stream error: {error.get('message') if isinstance(error, dict) else error}"


async def _read_srt_stream(
    response: aiohttp.ClientResponse, start: float, result: RequestResult
) -> str | None:
    """Fills `result` from /generate's chunks; returns the finish reason type, None if none came."""
    finish = None
    async for event in _events(response):
        if "error" in event:
            raise BadAnswer(_stream_error(event))
        # meta_info.completion_tokens is the total so far whether the server streams cumulative
        # output (srt's and SGLang's default) or deltas (--incremental-streaming-output)
        total = event["meta_info"].get("completion_tokens")
        new_tokens = (total if isinstance(total, int) else len(event["output_ids"])) - result.output_len
        if new_tokens > 0:
            result.chunk_times.append(time.perf_counter() - start)
            result.chunk_tokens.append(new_tokens)
            result.output_len += new_tokens
        reason = event["meta_info"]["finish_reason"]
        finish = reason.get("type") if isinstance(reason, dict) else None
    return finish


async def _read_openai_stream(
    response: aiohttp.ClientResponse, start: float, result: RequestResult
) -> str | None:
    finish, usage_tokens = None, None
    async for event in _events(response):
        if "error" in event:
            raise BadAnswer(_stream_error(event))
        if event.get("usage"):
            usage_tokens = int(event["usage"]["completion_tokens"])
        if event.get("choices"):
            result.chunk_times.append(time.perf_counter() - start)
            result.chunk_tokens.append(1)
            finish = event["choices"][0].get("finish_reason") or finish
    result.output_len = usage_tokens if usage_tokens is not None else len(result.chunk_times)
    return finish


def _finish_of(target: Target, body: dict[str, Any], result: RequestResult) -> str | None:
    """Output length and finish reason of a non-streamed answer."""
    if target.backend == "srt":
        result.output_len = len(body["output_ids"])
        reason = body["meta_info"]["finish_reason"]
        return reason.get("type") if isinstance(reason, dict) else None
    result.output_len = int(body["usage"]["completion_tokens"])
    return body["choices"][0].get("finish_reason")


async def send_request(
    client: aiohttp.ClientSession,
    target: Target,
    input_ids: list[int],
    output_len: int,
    stream: bool,
    result: RequestResult,
) -> None:
    """Fill `result` in place, so a timeout still leaves what arrived. Raises BadAnswer for an error
    event or a cut stream, aiohttp.ClientError on transport errors, asyncio.TimeoutError past the
    session's timeout, and ValueError, KeyError, TypeError or IndexError for an answer of the wrong shape."""
    payload = _payload(target, input_ids, output_len, stream)
    start = time.perf_counter()
    async with client.post(target.url, json=payload) as response:
        if response.status != 200:
            body = (await response.read()).decode(errors="replace")
            result.error = f"HTTP {response.status}: {body[:300]}"
            return
        if not stream:
            finish = _finish_of(target, _loads(await response.read()), result)
        elif target.backend == "srt":
            finish = await _read_srt_stream(response, start, result)
        else:
            finish = await _read_openai_stream(response, start, result)
    result.latency = time.perf_counter() - start
    if finish not in ("length", "stop"):  # srt and OpenAI name a request ended by an abort "abort"
        result.error = f"the request did not finish normally (finish_reason {finish!r})"
        return
    result.success = True


async def run_one(
    client: aiohttp.ClientSession,
    target: Target,
    input_ids: list[int],
    output_len: int,
    stream: bool,
    timeout_s: float,
    semaphore: asyncio.Semaphore | None,
) -> RequestResult:
    """One request, sent once `semaphore` admits it (times count from then); failures are recorded."""
    result = RequestResult(prompt_len=len(input_ids))
    if semaphore is not None:
        await semaphore.acquire()
    try:
        await asyncio.wait_for(send_request(client, target, input_ids, output_len, stream, result), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s} s"
    except BadAnswer as error:
        result.error = str(error)
    except (aiohttp.ClientError, ValueError, KeyError, TypeError, IndexError) as error:  # counted, not hidden
        result.error = f"{type(error).__name__}: {error}"
    finally:
        if semaphore is not None:
            semaphore.release()
    return result
