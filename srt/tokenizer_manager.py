"""TokenizerManager: the front end's half of a request, in the main process under uvicorn's loop.

It validates and tokenizes (bad input -> RequestError, an HTTP 400, before anything reaches a
rank), pushes TokenizedGenerateReq / AbortReq / control messages to scheduler rank 0, and routes
what the detokenizer sends back (BatchStrOut, ControlReply) to the waiting callers.

Usage: `call = tm.parse_generate(obj)` (synchronous, raises), then `async for out in
tm.generate(call, request)`. Streaming yields one dict per update with the *cumulative* text and
output ids so far (SGLang's /generate default); non-streaming yields each request's final dict.
Batch items carry "index". When the client disconnects, every unfinished request is aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from fastapi import Request
from transformers import AutoTokenizer

from srt.io_struct import (
    AbortReq,
    BatchStrOut,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    GetInternalStateReq,
    TokenizedGenerateReq,
)
from srt.sampling_params import SamplingParams
from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger("srt.tokenizer_manager")

GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "rid")
SHUTTING_DOWN = "server is shutting down"
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
DISCONNECT_CHECK_S = 0.5


class RequestError(ValueError):
    """Bad client input (HTTP 400); `param` names the offending parameter when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ServiceUnavailableError(RuntimeError):
    """The server cannot serve (a rank died, or a control/health reply did not come): HTTP 503."""


@dataclass
class GenerateCall:
    reqs: list[TokenizedGenerateReq]
    is_batch: bool
    stream: bool


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    wake: asyncio.Event  # shared by the requests of one call
    index: int | None  # position in a batch call; None for a single request
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    updated: bool = False

    def to_output(self) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": {
            "id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason.to_json() if self.finish_reason else None,
            "e2e_latency": time.perf_counter() - self.created}}
        if self.index is not None:
            out["index"] = self.index
        return out


def _is_token_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tokenizer_path: str,
                 model_info: dict[str, Any]) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.tokenizer_path = tokenizer_path
        self.model_info = model_info
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.context_length = int(model_info["context_length"])
        self.vocab_size = int(model_info["vocab_size"])
        self.max_total_tokens: int | None = model_info.get("max_total_tokens")
        self.rid_to_state: dict[str, ReqState] = {}
        self.failure: str | None = None  # set once by fail_all; every request gets 503 from then on
        self.draining = False  # set by begin_drain: new requests get 503, in-flight ones run on
        self._seed_counter = itertools.count()
        self._control_waiters: dict[str, asyncio.Future[ControlReply]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._send_sock: zmq.asyncio.Socket | None = None
        self._recv_sock: zmq.asyncio.Socket | None = None
        self._handle_task: asyncio.Task[None] | None = None

    @property
    def refusal(self) -> str | None:
        """Why a new request gets 503 now (a failure, or a shutdown under way); None while serving."""
        if self.failure is not None:
            return self.failure
        return SHUTTING_DOWN if self.draining else None

    @property
    def is_healthy(self) -> bool:
        return self.refusal is None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop serving this manager once started (fail_all is thread-safe regardless)."""
        return self._loop

    # ---- lifecycle ----
    def start(self) -> None:
        """Open the sockets and start handle_loop on the running loop (idempotent)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None:
            if self._loop is not loop:
                raise RuntimeError("TokenizerManager was started on another event loop")
            return
        self._loop = loop
        self._zmq = zmq.asyncio.Context()
        self._send_sock = self._zmq.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.connect(self.port_args.tokenizer_ipc)
        self._recv_sock = self._zmq.socket(zmq.PULL)
        self._recv_sock.bind(self.port_args.tokenizer_manager_ipc)
        self._handle_task = loop.create_task(self.handle_loop())

    async def close(self) -> None:
        if self._handle_task is not None:
            self._handle_task.cancel()
            await asyncio.gather(self._handle_task, return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
        self._loop = self._zmq = self._send_sock = self._recv_sock = self._handle_task = None

    def begin_drain(self) -> None:
        """A graceful shutdown begins: new requests and control calls get 503 SHUTTING_DOWN, while
        the requests in flight run to completion (or until fail_all ends them)."""
        self.draining = True

    def fail_all(self, message: str) -> None:
        """End every in-flight request and control call with a 503 carrying `message`; refuse new
        ones. Safe to call from any thread (supervision runs outside the event loop)."""
        if self.failure is None:
            self.failure = message
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wake_all()
        else:
            try:
                loop.call_soon_threadsafe(self._wake_all)
            except RuntimeError:  # the loop closed meanwhile: nobody is waiting
                pass

    def _wake_all(self) -> None:
        for state in self.rid_to_state.values():
            state.wake.set()
        for future in self._control_waiters.values():
            if not future.done():
                future.set_exception(ServiceUnavailableError(self.failure))

    # ---- validation ----
    def parse_generate(self, obj: Any) -> GenerateCall:
        """Validate and tokenize a /generate body. Raises RequestError (400) or ServiceUnavailableError."""
        if self.refusal is not None:
            raise ServiceUnavailableError(self.refusal)
        if not isinstance(obj, dict):
            raise RequestError("the request must be a JSON object")
        unknown = sorted(set(obj) - set(GENERATE_FIELDS))
        if unknown:
            raise RequestError(f"unknown parameter(s): {', '.join(unknown)} (allowed: {', '.join(GENERATE_FIELDS)})",
                               unknown[0])
        if (obj.get("text") is None) == (obj.get("input_ids") is None):
            both = obj.get("text") is not None
            raise RequestError("give either text or input_ids, not both" if both else
                               "a prompt is required: give text or input_ids", "input_ids" if both else "text")
        stream = obj.get("stream") or False
        if not isinstance(stream, bool):
            raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
        prompt_key = "text" if obj.get("text") is not None else "input_ids"
        prompts, is_batch = self._tokenize(obj["text"]) if prompt_key == "text" else self._check_ids(obj["input_ids"])
        params = self._sampling_params(obj.get("sampling_params"), len(prompts), is_batch)
        rids = self._rids(obj.get("rid"), len(prompts), is_batch)
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            total = len(ids) + sp.max_new_tokens
            where = f"{prompt_key}[{i}]: " if is_batch else ""
            param = "max_new_tokens" if len(ids) < self.context_length else prompt_key
            if total > self.context_length:
                raise RequestError(f"{where}the prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                                   f"{total} exceeds the context length ({self.context_length})", param)
            if self.max_total_tokens is not None and total > self.max_total_tokens:
                raise RequestError(f"{where}the prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                                   f"{total} exceeds the KV cache capacity ({self.max_total_tokens} tokens)", param)
        reqs = [TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=sp, seed=self._seed(sp), stream=stream)
                for rid, ids, sp in zip(rids, prompts, params)]
        return GenerateCall(reqs=reqs, is_batch=is_batch, stream=stream)

    def _tokenize(self, text: Any) -> tuple[list[list[int]], bool]:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a non-empty string or a non-empty list of non-empty strings", "text")
        for i, t in enumerate(texts):
            where = f"text[{i}]" if is_batch else "text"
            if not t:
                raise RequestError(f"{where} is empty", "text")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"{where} contains an unpaired surrogate (not valid Unicode)", "text") from None
        prompts = [list(ids) for ids in self.tokenizer(texts)["input_ids"]]
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError(f"text[{i}] tokenizes to no tokens" if is_batch else "text tokenizes to no tokens",
                                   "text")
        return prompts, is_batch

    def _check_ids(self, input_ids: Any) -> tuple[list[list[int]], bool]:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)",
                               "input_ids")
        is_batch = isinstance(input_ids[0], list)
        rows = input_ids if is_batch else [input_ids]
        for i, row in enumerate(rows):
            where = f"input_ids[{i}]" if is_batch else "input_ids"
            if not isinstance(row, list):
                raise RequestError(f"{where} must be a list of token ids", "input_ids")
            if not row:
                raise RequestError(f"{where} is empty", "input_ids")
            for token in row:
                if not _is_token_id(token, self.vocab_size):
                    raise RequestError(f"{where} holds {token!r}, not a token id in [0, {self.vocab_size})",
                                       "input_ids")
        return [list(row) for row in rows], is_batch

    def _sampling_params(self, raw: Any, n: int, is_batch: bool) -> list[SamplingParams]:
        if is_batch and isinstance(raw, list):
            if len(raw) != n:
                raise RequestError(f"sampling_params has {len(raw)} entries for a batch of {n}", "sampling_params")
            raws = raw
        else:
            raws = [raw] * n
        out = []
        for one in raws:
            for key, value in (one.items() if isinstance(one, dict) else ()):
                if isinstance(value, int) and abs(value) >= 2**63:  # JSON ints are unbounded; floats are not
                    raise RequestError(f"{key} is out of range: {value!r:.30}",
                                       key if key in _SAMPLING_FIELDS else "sampling_params")
            try:
                params = SamplingParams.from_dict(one)
                params.validate(self.vocab_size)
            except (ValueError, TypeError) as error:
                name = str(error).split(" ", 1)[0]
                raise RequestError(str(error), name if name in _SAMPLING_FIELDS else "sampling_params") from None
            out.append(params)
        return out

    def _rids(self, raw: Any, n: int, is_batch: bool) -> list[str]:
        if raw is None:
            return [uuid.uuid4().hex for _ in range(n)]
        rids = raw if is_batch else [raw]
        if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) and r for r in rids):
            shape = f"a list of {n} non-empty strings" if is_batch else "a non-empty string"
            raise RequestError(f"rid must be {shape}, got {raw!r}", "rid")
        if len(set(rids)) != n:
            raise RequestError("rid holds duplicates", "rid")
        self._check_rids_free(rids)
        return list(rids)

    def _check_rids_free(self, rids: list[str]) -> None:
        busy = [r for r in rids if r in self.rid_to_state]
        if busy:
            raise RequestError(f"rid {busy[0]!r} is already in flight", "rid")

    def _seed(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        # Deterministic per server seed and request order; every rank gets the resolved value.
        mixed = (self.server_args.random_seed * 0x9E3779B97F4A7C15 + next(self._seed_counter) * 0xBF58476D1CE4E5B9)
        return (mixed ^ (mixed >> 31)) & (2**63 - 1)

    # ---- generation ----
    async def generate(self, call: GenerateCall, request: Request | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Send the call's requests and yield outputs (see the module doc). Raises
        ServiceUnavailableError after fail_all; returns early when the client disconnects."""
        self.start()
        self._check_rids_free([req.rid for req in call.reqs])  # the rid may have been taken since parsing
        wake = asyncio.Event()
        states = [ReqState(req.rid, len(req.input_ids), wake, i if call.is_batch else None)
                  for i, req in enumerate(call.reqs)]
        self.rid_to_state.update((s.rid, s) for s in states)
        try:
            for req in call.reqs:
                await self._send(req)
            pending = list(states)
            last_check = time.perf_counter()
            while pending:
                try:
                    await asyncio.wait_for(wake.wait(), DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    pass
                wake.clear()
                if self.failure is not None:
                    raise ServiceUnavailableError(self.failure)
                if request is not None and time.perf_counter() - last_check >= DISCONNECT_CHECK_S:
                    last_check = time.perf_counter()
                    if await request.is_disconnected():
                        logger.info("client disconnected; aborting %s", [s.rid for s in pending])
                        return
                for state in list(pending):
                    if not state.updated:
                        continue
                    state.updated = False
                    if state.finish_reason is not None:
                        pending.remove(state)
                    if call.stream or state.finish_reason is not None:
                        yield state.to_output()
        finally:
            for state in states:
                if state.finish_reason is None and self.failure is None:
                    self._send_nowait(AbortReq(state.rid, "the client disconnected"))
                if self.rid_to_state.get(state.rid) is state:
                    del self.rid_to_state[state.rid]

    async def abort_request(self, rid: str, reason: str = "aborted by /abort_request") -> bool:
        """Ask every rank to abort `rid`; returns whether it was in flight here."""
        self.start()
        await self._send(AbortReq(rid, reason))
        return rid in self.rid_to_state

    async def health_generate(self, timeout: float = 20.0) -> None:
        """A 1-token greedy generation through every rank; ServiceUnavailableError unless it ends in time."""
        call = self.parse_generate({"text": "ping", "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}",
                                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        outputs = self.generate(call)
        try:
            out = await asyncio.wait_for(outputs.__anext__(), timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"health generation did not finish within {timeout} s") from None
        except StopAsyncIteration:
            raise ServiceUnavailableError("health generation ended without output") from None
        finally:
            await outputs.aclose()
        finish = out["meta_info"]["finish_reason"]
        if finish is None or finish["type"] == "abort":
            raise ServiceUnavailableError(f"health generation ended with finish_reason {finish}")

    # ---- control ----
    async def flush_cache(self, timeout: float = 10.0) -> ControlReply:
        return await self._control(FlushCacheReq, timeout)

    async def get_internal_state(self, timeout: float = 10.0) -> dict[str, Any]:
        return (await self._control(GetInternalStateReq, timeout)).payload

    async def _control(self, make: Callable[[str], Any], timeout: float) -> ControlReply:
        if self.refusal is not None:
            raise ServiceUnavailableError(self.refusal)
        self.start()
        assert self._loop is not None
        request_id = uuid.uuid4().hex
        future: asyncio.Future[ControlReply] = self._loop.create_future()
        self._control_waiters[request_id] = future
        try:
            await self._send(make(request_id))
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"no reply to {make.__name__} within {timeout} s") from None
        finally:
            self._control_waiters.pop(request_id, None)

    # ---- sockets ----
    async def _send(self, msg: Any) -> None:
        assert self._send_sock is not None
        await self._send_sock.send_pyobj(msg)

    def _send_nowait(self, msg: Any) -> None:
        """Send from a context that must not await (a generator being closed); never blocks (no HWM)."""
        if self._send_sock is not None and not self._send_sock.closed:
            self._send_sock.send_pyobj(msg, flags=zmq.NOBLOCK)

    async def handle_loop(self) -> None:
        """Route detokenizer output to the waiting requests; a failure here fails every request."""
        assert self._recv_sock is not None
        try:
            while True:
                self._dispatch(await self._recv_sock.recv_pyobj())
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("the response loop failed")
            self.fail_all(f"the response loop failed: {error!r}")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            for i, rid in enumerate(msg.rids):
                state = self.rid_to_state.get(rid)
                if state is None:  # finished, aborted or abandoned already
                    continue
                state.text += msg.texts[i]
                state.output_ids.extend(msg.new_token_ids[i])
                state.completion_tokens = msg.completion_tokens[i]
                state.cached_tokens = msg.cached_tokens[i]
                state.finish_reason = msg.finished_reasons[i]
                state.updated = True
                state.wake.set()
        elif isinstance(msg, ControlReply):
            future = self._control_waiters.pop(msg.request_id, None)
            if future is not None and not future.done():
                future.set_result(msg)
        else:
            logger.warning("ignoring an unexpected message %s", type(msg).__name__)
