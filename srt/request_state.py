"""What the front end holds for each request in flight: a ReqState per generation request, a
future per control call (ControlCalls); both end with ServiceUnavailableError when the server
cannot serve them.

The detokenizer sends increments (the new text and ids of each step); `ReqState.add_output`
accumulates them, so a streaming client gets the cumulative output so far, and after an engine
restart `replay` resends the request with what its client already has (ResumeState).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from srt.io_struct import BatchStrOut, ControlReply, FinishReason, ResumeState, TokenizedGenerateReq
from srt.logprob_meta import LogprobMeta
from srt.metrics import FrontendMetrics, RequestTiming


class ServiceUnavailableError(RuntimeError):
    """The server cannot serve (a rank died, or a control/health reply did not come): HTTP 503.
    `retry_after`: the condition passes by itself (memory pressure, a recovery), so the reply says
    when to try again."""

    def __init__(self, message: str, retry_after: bool = False) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    wake: asyncio.Event  # shared by the requests of one call
    index: int | None  # position in a batch call; None for a single request
    logprobs: LogprobMeta | None = None  # set when the request asked for logprobs
    timing: RequestTiming = field(default_factory=RequestTiming)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    updated: bool = False
    streamed_ids: int = 0  # output ids (and chars of text) an incremental stream has sent
    streamed_text: int = 0
    sent: TokenizedGenerateReq | None = None  # what went to rank 0 (replayed after a restart)
    replays: int = 0
    prompt_token_ids: list[int] | None = None  # returned with the output (return_prompt_token_ids)
    log_metrics: bool = True  # SGLang's log_metrics: false leaves the request out of /metrics
    first_output_at: float | None = None  # perf_counter time of the first output token (deadlines)
    deadline_abort_sent: bool = False
    routed_experts: str | None = None  # base64 int32 [tokens, layers, top_k], with the last output
    embedding: list[float] | None = None  # --is-embedding: the prompt's, with the last output
    weight_version: str = "default"  # the weights' version when its latest output came
    # (the version before a change, output tokens by then) for each change of weights or version
    # while it ran: SGLang's weight_versions spans (srt/weight_updates.py)
    version_changes: list[tuple[str, int]] = field(default_factory=list)

    def add_output(self, out: BatchStrOut, i: int, metrics: FrontendMetrics | None) -> None:
        """Take row i of `out` (text and ids are increments, the token counts totals) and wake the caller."""
        self.text += out.texts[i]
        self.output_ids.extend(out.new_token_ids[i])
        if self.first_output_at is None and out.new_token_ids[i]:
            self.first_output_at = time.perf_counter()
        self.completion_tokens = out.completion_tokens[i]
        if not self.replays:  # a replay's prefix hits are not the client's
            self.cached_tokens = out.cached_tokens[i]
        self.finish_reason = out.finished_reasons[i]
        if self.logprobs is not None and out.output_logprobs:
            self.logprobs.add(out.output_logprobs[i], out.input_logprobs[i])
        if out.routed_experts and out.routed_experts[i] is not None:
            self.routed_experts = out.routed_experts[i]
        if out.embeddings and out.embeddings[i] is not None:
            self.embedding = out.embeddings[i]
        if metrics is not None and self.log_metrics:
            self._record_metrics(metrics)
        self.updated = True
        self.wake.set()

    def _record_metrics(self, metrics: FrontendMetrics) -> None:
        now = time.perf_counter()
        metrics.on_tokens(self.rid, self.timing, self.completion_tokens, now)
        if self.finish_reason is not None:
            metrics.on_finish(
                self.rid,
                self.finish_reason.type,
                self.prompt_tokens,
                self.completion_tokens,
                self.cached_tokens,
                now - self.timing.created,
            )

    def replay(self) -> TokenizedGenerateReq:
        """The request again, continuing after the output the client already has."""
        assert self.sent is not None
        if not self.output_ids:
            return self.sent
        return dataclasses.replace(self.sent, resume=ResumeState(list(self.output_ids), len(self.text)))

    def to_output(self, incremental: bool = False) -> dict[str, Any]:
        """The output so far; `incremental` (--incremental-streaming-output): only what the previous
        incremental call did not return (meta_info's counts stay totals)."""
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason.to_json() if self.finish_reason else None,
            "e2e_latency": time.perf_counter() - self.timing.created,
            "weight_version": self.weight_version,
        }
        if self.finish_reason is not None:
            spans = version_spans(self.version_changes, self.weight_version, len(self.output_ids))
            meta["weight_versions"], meta["weight_version"] = spans, spans[-1]["version"]
        if self.routed_experts is not None:
            meta["routed_experts"] = self.routed_experts
        ids_from, text_from = (self.streamed_ids, self.streamed_text) if incremental else (0, 0)
        if self.logprobs is not None:
            meta.update(self.logprobs.meta_info(ids_from))
        out: dict[str, Any] = {
            "text": self.text[text_from:],
            "output_ids": self.output_ids[ids_from:],
            "meta_info": meta,
        }
        if incremental:
            self.streamed_ids, self.streamed_text = len(self.output_ids), len(self.text)
        if self.index is not None:
            out["index"] = self.index
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        if self.embedding is not None:
            out["embedding"] = self.embedding
        return out


def version_spans(changes: list[tuple[str, int]], current: str, tokens: int) -> list[dict[str, Any]]:
    """SGLang's weight_versions: which version produced output tokens [start, end), in order (a
    change before the first token leaves no span of its old version)."""
    spans: list[dict[str, Any]] = []
    for version, end in [*changes, (current, tokens)]:
        end = min(end, tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class ControlCalls:
    """Control calls in flight (flush_cache, get_internal_state): one future per request id, which
    the ControlReply naming that id resolves."""

    def __init__(self) -> None:
        self._waiters: dict[str, asyncio.Future[ControlReply]] = {}

    async def call(
        self, make: Callable[[str], Any], send: Callable[[Any], Awaitable[None]], timeout: float | None
    ) -> ControlReply:
        """Send make(request_id) and wait for its reply; ServiceUnavailableError after `timeout` s
        (None: as long as it takes; a restart or a failure still ends the wait, fail_all)."""
        request_id = uuid.uuid4().hex
        future: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        try:
            await send(make(request_id))
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"no reply to {make.__name__} within {timeout} s") from None
        finally:
            self._waiters.pop(request_id, None)

    def deliver(self, reply: ControlReply) -> None:
        future = self._waiters.pop(reply.request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def fail_all(self, message: str) -> None:
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(ServiceUnavailableError(message))
