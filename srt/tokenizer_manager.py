"""TokenizerManager: the front end's half of a request, in the main process under uvicorn's loop.

It validates and tokenizes (bad input -> RequestError, an HTTP 400, before anything reaches a
rank), pushes TokenizedGenerateReq / AbortReq / control messages to scheduler rank 0, and routes
what the detokenizer sends back (BatchStrOut, ControlReply; with --is-embedding the output rank's
BatchTokenIDOut, directly) to the waiting callers.

Usage: `call = tm.parse_generate(obj)` (synchronous, raises; generate_parse.py), then `async for
out in tm.generate(call, request)`. Streaming yields one dict per update with the *cumulative*
text, output ids and logprobs so far (SGLang's /generate default; with `incremental`, as
--incremental-streaming-output asks of /generate, only what is new since the previous chunk);
non-streaming yields each request's final dict. Batch items carry "index". When the client disconnects, every unfinished
request is aborted. With --enable-metrics it records the front end's series (metrics.py).

Engine restarts: the manager's FrontendRecovery (srt/frontend_recovery.py, driven by recovery.py)
holds new requests back and replays the ones in flight; a request in flight never notices.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from fastapi import Request

from model_executor.constrained import JsonOptions, LazyGrammarBackend
from srt.frontend_recovery import FrontendRecovery
from srt.generate_parse import GenerateCall, GenerateParser, RequestError
from srt.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenIDOut,
    ControlReply,
    FlushCacheReq,
    GetInternalStateReq,
    GetLoadReq,
    LoadLoraAdapterReq,
    ReleaseMemoryReq,
    UnloadLoraAdapterReq,
)
from srt.logprob_meta import LogprobMeta
from srt.lora_config import LoraRef, check_adapter
from srt.lora_residency import LoraResidency
from srt.memory_watch import (
    GIB,
    POLL_S,
    MemoryWatch,
    ProcessMemoryCollector,
    available_memory,
    process_memory,
)
from srt.metrics import FrontendMetrics, metrics_dir
from srt.request_state import ControlCalls, ReqState, ServiceUnavailableError
from srt.sampling_params import SamplingParams
from srt.server_args import PortArgs, ServerArgs
from srt.tokenizer_loader import load_tokenizer
from srt.weight_updates import WeightUpdates

logger = logging.getLogger("srt.tokenizer_manager")

__all__ = ["GenerateCall", "ReqState", "RequestError", "ServiceUnavailableError", "TokenizerManager"]

SHUTTING_DOWN = "server is shutting down"
DISCONNECT_CHECK_S = 0.5


class TokenizerManager:
    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, tokenizer_path: str, model_info: dict[str, Any]
    ) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.tokenizer_path = tokenizer_path
        self.model_info = model_info
        self.tokenizer = load_tokenizer(tokenizer_path)
        if server_args.chat_template is not None:  # --chat-template: checked to be a file
            self.tokenizer.chat_template = Path(server_args.chat_template).read_text()
        self.context_length = int(model_info["context_length"])
        self.vocab_size = int(model_info["vocab_size"])
        self.max_total_tokens: int | None = model_info.get("max_total_tokens")
        # the LoRA adapters requests may name (--lora-paths); None: LoRA off
        self.lora_names: dict[str, str] | None = (
            {ref.name: ref.path for ref in server_args.lora_adapters} if server_args.lora_enabled else None
        )
        self.lora_residency = LoraResidency(
            server_args.max_loaded_loras, server_args.lora_eviction_policy, self.lora_names or ()
        )
        grammars = LazyGrammarBackend(
            server_args.grammar_backend,
            lambda: self.tokenizer,
            self.vocab_size,
            model_info.get("eos_token_ids") or (),
            JsonOptions.of(server_args),
        )
        self.parser = GenerateParser(
            self.tokenizer,
            self.vocab_size,
            self.context_length,
            self.max_total_tokens,
            self._seed,
            server_args.enable_priority_scheduling,
            grammars,
            server_args.enable_return_routed_experts,
            self.lora_names,
        )
        self.metrics = (
            FrontendMetrics(metrics_dir(port_args), server_args.model_name, self.max_total_tokens)
            if server_args.enable_metrics
            else None
        )
        self.rid_to_state: dict[str, ReqState] = {}
        self.failure: str | None = None  # set once by fail_all; every request gets 503 from then on
        self.draining = False  # set by begin_drain: new requests get 503, in-flight ones run on
        self._seed_counter = itertools.count()
        self._control_calls = ControlCalls()
        self.recovery = FrontendRecovery(
            server_args.max_running_requests,
            self.rid_to_state,
            self._send_nowait,
            lambda: self.failure,
            self._control_calls,
        )
        # the weights' version, pause and updates (SGLang's RL protocol: srt/weight_updates.py)
        self.weights = WeightUpdates(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._send_sock: zmq.asyncio.Socket | None = None
        self._recv_sock: zmq.asyncio.Socket | None = None
        self._handle_task: asyncio.Task[None] | None = None
        self.memory_watch = MemoryWatch(int(server_args.min_available_memory * GIB))
        self._memory_task: asyncio.Task[None] | None = None
        # (name, pid) of this node's processes; launch_server sets the children's (restarts replace them)
        self.processes: Callable[[], list[tuple[str, int]]] = lambda: [("main", os.getpid())]
        if self.metrics is not None:
            self.metrics.registry.register(ProcessMemoryCollector(lambda: self.processes()))

    @property
    def refusal(self) -> str | None:
        """Why a new request gets 503 now (a failure, or a shutdown under way); None while serving."""
        if self.failure is not None:
            return self.failure
        return SHUTTING_DOWN if self.draining else None

    @property
    def unhealthy(self) -> str | None:
        """Why /health says 503 (a failure, a shutdown, a restart under way); None while serving."""
        if self.refusal is None and self.recovery.reason is not None:
            return f"recovering: {self.recovery.reason}"
        return self.refusal

    @property
    def is_healthy(self) -> bool:
        return self.unhealthy is None

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
        self._open_sockets()
        if self.memory_watch.threshold > 0:
            self._memory_task = loop.create_task(self._watch_memory())

    async def _watch_memory(self) -> None:
        """srt/memory_watch.py: the one reading of host memory that decides anything."""
        while True:
            if self.memory_watch.poll(time.monotonic()) and self.failure is None:
                self._send_nowait(ReleaseMemoryReq(self.memory_watch.pressure or ""))
            await asyncio.sleep(POLL_S)

    def _open_sockets(self) -> None:
        assert self._zmq is not None and self._loop is not None
        self._send_sock = self._zmq.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.connect(self.port_args.tokenizer_ipc)
        self._recv_sock = self._zmq.socket(zmq.PULL)
        # an embedding server has no detokenizer: the output rank's messages come here directly
        embed = self.server_args.is_embedding
        self._recv_sock.bind(
            self.port_args.detokenizer_ipc if embed else self.port_args.tokenizer_manager_ipc
        )
        self._handle_task = self._loop.create_task(self.handle_loop())

    async def close(self) -> None:
        if self._memory_task is not None:
            self._memory_task.cancel()
            await asyncio.gather(self._memory_task, return_exceptions=True)
            self._memory_task = None
        if self._handle_task is not None:
            self._handle_task.cancel()
            await asyncio.gather(self._handle_task, return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
        self._loop = self._zmq = self._send_sock = self._recv_sock = self._handle_task = None

    async def reset_channels(self) -> None:
        """Replace the sockets (an engine restart, recovery.py): call once the old engine's processes
        are dead and before the new ones start. Whatever they sent and was not read yet is dropped
        (those tokens are generated again), and no message queued for the old rank 0 reaches the new
        one."""
        if self._zmq is None:
            return
        if self._handle_task is not None:
            self._handle_task.cancel()
            await asyncio.gather(self._handle_task, return_exceptions=True)
        for sock in (self._send_sock, self._recv_sock):
            if sock is not None:
                sock.close(linger=0)
        self._open_sockets()

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
        self.recovery.wake()  # the held-back requests see the failure
        self._control_calls.fail_all(self.failure or "")

    # ---- validation ----
    def lora_of_model(self, model: Any) -> str | None:
        """The LoRA adapter an OpenAI `model` names: the adapter's own name (vLLM) or base:adapter
        (SGLang); None for the base model (any other name: a worker serves whatever it is asked
        for, as SGLang). RequestError naming `model` for base:adapter with no such adapter."""
        names = self.lora_names
        if names is None or not isinstance(model, str) or model == self.server_args.model_name:
            return None
        if model in names:
            return model
        _, sep, adapter = model.rpartition(":")
        if not sep:
            return None
        if adapter not in names:
            known = ", ".join(sorted(names)) or "none"
            raise RequestError(
                f"model {model!r}: no LoRA adapter named {adapter!r} (loaded: {known})", "model"
            )
        return adapter

    def parse_generate(self, obj: Any, embed: bool = False) -> GenerateCall:
        """Validate and tokenize a /generate body (`embed`: an embedding request's, from /v1/embeddings
        or /encode). Raises RequestError (400) or ServiceUnavailableError."""
        self.check_kind(embed)
        if self.refusal is not None:
            raise ServiceUnavailableError(self.refusal)
        if self.memory_watch.pressure is not None:
            raise ServiceUnavailableError(self.memory_watch.pressure, retry_after=True)
        overflow = self.recovery.overflow()
        if overflow is not None:
            raise ServiceUnavailableError(overflow, retry_after=True)
        return self.parser.parse(obj, self.rid_to_state)

    def check_kind(self, embed: bool) -> None:
        """RequestError unless this server does what the route asks: embed (--is-embedding) or generate."""
        if embed != self.server_args.is_embedding:
            raise RequestError(
                "this server serves embeddings (--is-embedding): use /v1/embeddings or /encode"
                if self.server_args.is_embedding
                else "embeddings need a server started with --is-embedding (this one generates)"
            )

    def _check_rids_free(self, rids: list[str]) -> None:
        busy = [r for r in rids if r in self.rid_to_state]
        if busy:
            raise RequestError(f"rid {busy[0]!r} is already in flight", "rid")

    def _seed(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        # Deterministic per server seed and request order; every rank gets the resolved value.
        mixed = (
            self.server_args.random_seed * 0x9E3779B97F4A7C15 + next(self._seed_counter) * 0xBF58476D1CE4E5B9
        )
        return (mixed ^ (mixed >> 31)) & (2**63 - 1)

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        """One text per token id (logprob entries name their tokens)."""
        return [str(t) for t in self.tokenizer.batch_decode([[i] for i in token_ids])]

    # ---- generation ----
    async def generate(
        self, call: GenerateCall, request: Request | None = None, incremental: bool = False
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Send the call's requests and yield outputs (see the module doc; `incremental`: a stream's
        chunks carry only what is new since the previous one). Raises ServiceUnavailableError
        after fail_all; returns early when the client disconnects."""
        self.start()
        self._check_rids_free([req.rid for req in call.reqs])  # the rid may have been taken since parsing
        wake = asyncio.Event()
        decode = self.decode_tokens if call.return_text_in_logprobs else None
        states = [
            ReqState(
                req.rid,
                len(req.input_ids),
                wake,
                i if call.is_batch else None,
                LogprobMeta(
                    req.top_logprobs_num, req.logprob_start_len, decode, req.token_ids_logprob is not None
                )
                if req.return_logprob
                else None,
                prompt_token_ids=list(req.input_ids) if call.return_prompt_token_ids else None,
                log_metrics=call.log_metrics,
            )
            for i, req in enumerate(call.reqs)
        ]
        self.rid_to_state.update((s.rid, s) for s in states)
        self.lora_residency.used(req.lora_path for req in call.reqs if req.lora_path)
        try:
            await self.weights.until_unpaused()
            await self.recovery.until_recovered(len(call.reqs))
            for req, state in zip(call.reqs, states):
                state.sent = req  # with the send, no await between: a restart replays exactly the sent ones
            # a batch in one message, as SGLang's BatchTokenizedGenerateReqInput: the scheduler
            # receives it whole, so its requests start in one step rather than split by their arrival
            self._send_nowait(call.reqs[0] if len(call.reqs) == 1 else list(call.reqs))
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
                self._send_deadline_aborts(pending)
                for state in list(pending):
                    if not state.updated:
                        continue
                    state.updated = False
                    if state.finish_reason is not None:
                        pending.remove(state)
                    if call.stream or state.finish_reason is not None:
                        yield state.to_output(incremental and call.stream)
        finally:
            for state in states:
                if state.finish_reason is None and self.failure is None:
                    self._send_nowait(AbortReq(state.rid, "the client disconnected"))
                if self.rid_to_state.get(state.rid) is state:
                    del self.rid_to_state[state.rid]

    def _send_deadline_aborts(self, pending: list[ReqState]) -> None:
        """SGLang's waiting and running timeouts, decided here alone: a rank timing requests out on
        its own clock would abort a different set than the others and the collectives would part.
        The abort goes through rank 0's broadcast like a client's, so every rank drops the request
        in the same step. Checked every DISCONNECT_CHECK_S at most."""
        waiting, running = self.server_args.req_waiting_timeout, self.server_args.req_running_timeout
        if waiting is None and running is None:
            return
        now = time.perf_counter()
        for state in pending:
            if state.deadline_abort_sent or state.finish_reason is not None:
                continue
            if state.first_output_at is None:
                late = waiting is not None and now - state.timing.created > waiting
                reason = "Request waiting timeout reached."
            else:
                late = running is not None and now - state.first_output_at > running
                reason = "Request running timeout reached."
            if late:
                state.deadline_abort_sent = True
                logger.info("%s: %s", state.rid, reason)
                self._send_nowait(AbortReq(state.rid, reason, status_code=503))

    async def abort_request(self, rid: str, reason: str = "aborted by /abort_request") -> bool:
        """Ask every rank to abort `rid`; returns whether it was in flight here."""
        self.start()
        await self._send(AbortReq(rid, reason))
        return rid in self.rid_to_state

    async def health_generate(self, timeout: float = 20.0) -> None:
        """A 1-token greedy generation (an embedding) through every rank; ServiceUnavailableError unless it ends in time."""
        embed = self.server_args.is_embedding  # an embedding server embeds the probe instead
        call = self.parse_generate(
            {
                "text": "ping",
                "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}",
                "sampling_params": {"max_new_tokens": 0 if embed else 1, "temperature": 0},
            },
            embed=embed,
        )
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

    def memory_report(self) -> dict[str, Any]:
        """/server_info's "memory": each process's resident bytes and the host's available memory."""
        return {
            "processes": process_memory(self.processes()),
            "host_available_bytes": available_memory(),
            "min_available_memory_bytes": self.memory_watch.threshold,
            "pressure": self.memory_watch.pressure,
        }

    # ---- control ----
    async def flush_cache(self, timeout: float = 10.0) -> ControlReply:
        return await self._control(FlushCacheReq, timeout)

    async def clear_hicache_storage(self, timeout: float = 60.0) -> ControlReply:
        """SGLang's /hicache/storage-backend/clear: every rank deletes its disk tier's files."""
        return await self._control(lambda request_id: FlushCacheReq(request_id, storage=True), timeout)

    async def get_internal_state(self, timeout: float = 10.0) -> dict[str, Any]:
        return (await self._control(GetInternalStateReq, timeout)).payload

    async def get_load(self, timeout: float = 10.0) -> dict[str, Any]:
        return (await self._control(GetLoadReq, timeout)).payload

    # ---- LoRA adapters at runtime (scheduler/lora_registry.py holds each rank's registry) ----
    async def load_lora_adapter(self, name: Any, path: Any, pinned: Any = False) -> dict[str, Any]:
        """Loads the peft folder `path` as the adapter `name` on every rank (usable once every rank
        has its shard). Returns the reply's payload (loaded_adapters: name -> folder); RequestError
        naming the cause otherwise, the registry unchanged on every rank."""
        names = self._lora_names("lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"lora_name must be a non-empty string, got {name!r}", "lora_name")
        if not isinstance(path, str) or not path:
            raise RequestError(f"lora_path must be an adapter's folder, got {path!r}", "lora_path")
        if not isinstance(pinned, bool):
            raise RequestError(f"pinned must be true or false, got {pinned!r}", "pinned")
        if name in names:
            raise RequestError(f"a LoRA adapter named {name!r} is loaded already", "lora_name")
        args = self.server_args
        try:  # what the front end can check alone, before any rank reads a tensor
            check_adapter(LoraRef(name, path), args.max_lora_rank, args.lora_target_modules)
        except (ValueError, OSError) as error:
            raise RequestError(str(error), "lora_path") from None
        reply = await self._control(lambda rid: LoadLoraAdapterReq(rid, name, path, pinned), None)
        if not reply.success:
            raise RequestError(str(reply.payload.get("message")), "lora_path")
        names[name] = path
        self.recovery.record_lora(name, path)
        self.lora_residency.loaded(name, pinned)
        for victim in self.lora_residency.over_bound():  # --max-loaded-loras: the first to leave
            logger.info("unloading LoRA adapter %r: more than --max-loaded-loras are loaded", victim)
            await self.unload_lora_adapter(victim)
        return {**reply.payload, "loaded_adapters": dict(names)}

    async def unload_lora_adapter(self, name: Any) -> dict[str, Any]:
        """Unloads the adapter `name`: new requests naming it are refused at once; the call returns
        once no request running or queued uses it (they finish with the adapter, never broken).
        Returns the reply's payload; RequestError for no such adapter."""
        names = self._lora_names("lora_name")
        if not isinstance(name, str) or name not in names:
            raise RequestError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        path = names.pop(name)
        try:
            reply = await self._control(lambda rid: UnloadLoraAdapterReq(rid, name), None)
        except ServiceUnavailableError:
            names[name] = path  # not unloaded: a restart loads it again (FrontendRecovery)
            raise
        if not reply.success:
            raise RequestError(str(reply.payload.get("message")), "lora_name")
        self.recovery.record_lora(name, None)
        self.lora_residency.unloaded(name)
        return reply.payload

    def _lora_names(self, param: str) -> dict[str, str]:
        if self.lora_names is None:
            raise RequestError("LoRA adapters need a server started with --enable-lora", param)
        return self.lora_names

    def abort_all(self, reason: str) -> int:
        """Asks every rank to abort every request in flight; how many were."""
        rids = [rid for rid, state in self.rid_to_state.items() if state.finish_reason is None]
        for rid in rids:
            self._send_nowait(AbortReq(rid, reason))
        return len(rids)

    async def control(self, make: Callable[[str], Any], timeout: float | None = None) -> ControlReply:
        """A control message to every rank and its reply (srt/weight_updates.py's calls)."""
        return await self._control(make, timeout)

    async def _control(self, make: Callable[[str], Any], timeout: float | None) -> ControlReply:
        if self.unhealthy is not None:
            raise ServiceUnavailableError(self.unhealthy)
        self.start()
        return await self._control_calls.call(make, self._send, timeout)

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
        if isinstance(msg, BatchTokenIDOut):  # --is-embedding: from the output rank
            msg = BatchStrOut.without_text(msg)
        if isinstance(msg, BatchStrOut):
            for i, rid in enumerate(msg.rids):
                state = self.rid_to_state.get(rid)
                if state is None:  # finished, aborted or abandoned already
                    continue
                state.add_output(msg, i, self.metrics)
                state.weight_version = self.weights.version
        elif isinstance(msg, ControlReply):
            self.weights.replied(msg)  # a new version serves from the reply on, in output order
            self._control_calls.deliver(msg)
        else:
            logger.warning("ignoring an unexpected message %s", type(msg).__name__)
