"""Request state inside a scheduler rank. Counters are stored; everything else is derived."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from model_executor.constrained import Matcher
from srt.io_struct import FinishReason, ResumeState, TokenizedGenerateReq, TokenLogprobs
from srt.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    """One request on one rank.

    token ids:  |------ origin_input_ids ------|--- output_ids ---|
    KV written: |-- cached_len --|-- computed --|  (kv_len tokens)  the last sampled token
                                                                     has no KV until fed back
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None  # row of req_to_token while holding KV
    kv_len: int = 0  # tokens whose KV is in the pool for this request
    cached_len: int = 0  # leading tokens whose KV belongs to the prefix cache (locked via last_node)
    cached_tokens: int = 0  # prefix-cache hits reported to the client (first admission)
    last_node: Any = None  # radix node locked while this request holds the prefix
    finished_reason: FinishReason | None = None
    sent_len: int = 0  # output ids already streamed out
    # A replay after an engine restart starts with the output ids the client already has: they
    # count for output positions (sampling), max_new_tokens and stop checks like any other, but
    # their logprobs are with the front end (output_logprobs covers output_ids[resumed_len:]).
    resumed_len: int = 0
    resume: ResumeState | None = None  # sent with the replay's first output (the detokenizer's seed)
    decode_spec_sent: bool = (
        False  # the detokenizer has this request's DecodeSpec (sent with its first output)
    )
    retractions: int = 0
    awaiting_token: bool = False  # launched in a batch whose sampled token is not appended yet
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: output tokens only; k >= 0: prompt tokens k.. as well
    token_ids_logprob: list[int] | None = None  # these ids' logprobs at every scored position
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts: str | None = None  # read from the runner when the request finishes
    embedding: list[float] | None = None  # --is-embedding: the pooled prompt, after its prefill
    priority: int | None = None  # with --enable-priority-scheduling (scheduler/policy.py order_waiting)
    grammar: Matcher | None = None  # a constrained request's matcher (scheduler/grammar.py), on every rank
    lora_id: int = 0  # the LoRA adapter it runs under (0: the base model; srt/lora_config.py)
    weight_epoch: int = 0  # the weights that compute its KV (scheduler/weight_registry.py)
    # Logprobs, filled on the output rank only (no rank decides anything from them).
    output_logprobs: TokenLogprobs = field(default_factory=lambda: TokenLogprobs([], [], []))
    input_logprobs: TokenLogprobs = field(default_factory=lambda: TokenLogprobs([], [], []))

    def __post_init__(self) -> None:
        if not self.origin_input_ids:
            raise ValueError(f"request {self.rid}: empty prompt")
        if not 0 <= self.resumed_len == len(self.output_ids) <= self.sampling_params.max_new_tokens:
            raise ValueError(
                f"request {self.rid}: {len(self.output_ids)} resumed output tokens do not fit "
                f"max_new_tokens {self.sampling_params.max_new_tokens}"
            )
        if not -1 <= self.logprob_start_len < len(self.origin_input_ids):
            raise ValueError(
                f"request {self.rid}: logprob_start_len {self.logprob_start_len} is outside "
                f"[-1, {len(self.origin_input_ids)})"
            )

    @classmethod
    def of(cls, msg: TokenizedGenerateReq, lora_id: int = 0) -> Req:
        """The request of a front end's message (a replay's starts with the outputs already sent),
        under the adapter the rank's registry gives msg.lora_path."""
        resumed = list(msg.resume.output_ids) if msg.resume is not None else []
        return cls(
            msg.rid,
            list(msg.input_ids),
            msg.sampling_params,
            msg.seed,
            msg.stream,
            output_ids=resumed,
            sent_len=len(resumed),
            resumed_len=len(resumed),
            resume=msg.resume,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
            token_ids_logprob=msg.token_ids_logprob,
            priority=msg.priority,
            return_routed_experts=msg.return_routed_experts,
            routed_experts_start_len=msg.routed_experts_start_len,
            lora_id=lora_id,
        )

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def max_total_len(self) -> int:
        return len(self.origin_input_ids) + self.sampling_params.max_new_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """Prompt positions whose next-token logits the request's prompt logprobs still need
        (position p scores token p + 1), computed by the prefill steps to come. Empty once the
        prompt is done: a retracted request keeps what it had, nothing is computed twice.

            prompt:  |-- t0 --|-- ... --|-- t(k-1) --|-- tk --|-- ... --|-- t(n-1) --|
            logits:             positions max(k-1, 0) .. n-2 score tokens max(k, 1) .. n-1
        """
        if not self.return_logprob or self.logprob_start_len < 0 or self.output_ids:
            return range(0)
        return range(max(self.logprob_start_len - 1, 0), len(self.origin_input_ids) - 1)

    @property
    def max_cached_prefix_len(self) -> int:
        """Prompt logprobs need the logits of positions a prefix-cache hit would skip: limit it."""
        positions = self.prompt_logprob_positions
        return positions.start if positions else self.seq_len

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    def own_slots(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """KV slots this request owns outright (not shared with the prefix cache)."""
        assert self.req_pool_idx is not None
        return req_to_token[self.req_pool_idx, self.cached_len : self.kv_len]
