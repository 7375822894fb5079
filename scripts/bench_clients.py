"""The HTTP side of the serving benchmark: which API a server speaks, and one timed request on it.

Two backends, both greedy with `ignore_eos` so every request makes exactly its output length:
- `srt`: srt's native `POST /generate` with `input_ids`; each streamed chunk carries the cumulative
  `output_ids`, so the tokens per chunk are known exactly.
- `openai`: `POST /v1/completions` with a token-id `prompt` (vLLM, SGLang and srt accept one) and
  `stream_options.include_usage`. The tokens per chunk are not visible there: each chunk counts as
  one token for TTFT / ITL (as vLLM's and SGLang's benchmarks count them), and the output length is
  the final `usage.completion_tokens` when the server sends it, else the number of chunks.
`auto` picks `srt` when `GET /server_info` names a `vocab_size` (srt's front end does), else `openai`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from bench_metrics import RequestResult

BACKENDS = ("auto", "srt", "openai")


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


async def _get_json(client: httpx.AsyncClient, url: str) -> Any:
    """The JSON body of a 200 answer, else None (the route is missing or failing on this server)."""
    response = await client.get(url)
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


async def resolve_target(client: httpx.AsyncClient, base_url: str, backend: str = "auto",
                         model: str | None = None) -> tuple[Target, int | None]:
    """The target to benchmark and the vocabulary size the server reports (None when it does not).

    Raises httpx.HTTPError when the server cannot be reached, ValueError for an unknown backend or an
    OpenAI server that lists no model (pass `model` then)."""
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
        return {"input_ids": input_ids, "stream": stream,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}
    payload: dict[str, Any] = {"model": target.model, "prompt": input_ids, "max_tokens": output_len,
                               "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE stream; raises BadAnswer when it ends without `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise BadAnswer("the stream ended without data: [DONE]")


def _stream_error(event: dict[str, Any]) -> str:
    error = event["error"]
    return f"stream error: {error.get('message') if isinstance(error, dict) else error}"


async def _read_srt_stream(response: httpx.Response, start: float, result: RequestResult) -> str | None:
    """Fills `result` from /generate's chunks; returns the finish reason type, None if none came."""
    finish = None
    async for event in _events(response):
        if "error" in event:
            raise BadAnswer(_stream_error(event))
        new_tokens = len(event["output_ids"]) - result.output_len
        if new_tokens > 0:
            result.chunk_times.append(time.perf_counter() - start)
            result.chunk_tokens.append(new_tokens)
            result.output_len += new_tokens
        reason = event["meta_info"]["finish_reason"]
        finish = reason.get("type") if isinstance(reason, dict) else None
    return finish


async def _read_openai_stream(response: httpx.Response, start: float, result: RequestResult) -> str | None:
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


async def send_request(client: httpx.AsyncClient, target: Target, input_ids: list[int], output_len: int,
                       stream: bool, result: RequestResult) -> None:
    """Fill `result` in place, so a timeout still leaves what arrived. Raises BadAnswer for an error
    event or a cut stream, httpx.HTTPError on transport errors, and ValueError, KeyError, TypeError
    or IndexError for an answer of the wrong shape."""
    payload = _payload(target, input_ids, output_len, stream)
    start = time.perf_counter()
    async with client.stream("POST", target.url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {body[:300]}"
            return
        if not stream:
            finish = _finish_of(target, json.loads(await response.aread()), result)
        elif target.backend == "srt":
            finish = await _read_srt_stream(response, start, result)
        else:
            finish = await _read_openai_stream(response, start, result)
    result.latency = time.perf_counter() - start
    if finish not in ("length", "stop"):  # srt and OpenAI name a request ended by an abort "abort"
        result.error = f"the request did not finish normally (finish_reason {finish!r})"
        return
    result.success = True


async def run_one(client: httpx.AsyncClient, target: Target, input_ids: list[int], output_len: int, stream: bool,
                  timeout_s: float, semaphore: asyncio.Semaphore | None) -> RequestResult:
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
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as error:  # counted, not hidden
        result.error = f"{type(error).__name__}: {error}"
    finally:
        if semaphore is not None:
            semaphore.release()
    return result
