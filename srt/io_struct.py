"""Wire messages between the front end, the scheduler ranks and the detokenizer.

Flow: TokenizerManager --(ZMQ)--> scheduler rank 0 --(gloo broadcast_pyobj)--> every rank;
output rank --(ZMQ)--> detokenizer --(ZMQ)--> TokenizerManager (with --is-embedding the output rank
sends to the TokenizerManager directly: there is no text to decode). Everything is pickled; keep
messages small (a decode step sends new token ids, never whole sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from srt.sampling_params import SamplingParams

# ---- front end -> schedulers (rank 0 receives, broadcasts to all) ----


@dataclass
class ResumeState:
    """What the client already has of a request replayed after an engine restart (srt/recovery.py)."""

    output_ids: list[int]  # delivered output tokens: the replay continues at output position len(output_ids)
    text_len: int  # characters of text delivered; the rest of decode(output_ids) was held back


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved by the front end (request seed or derived), so every rank samples alike
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0  # alternatives per position (with return_logprob)
    logprob_start_len: int = -1  # -1: output tokens only; k >= 0: prompt tokens from position k too
    token_ids_logprob: list[int] | None = (
        None  # these ids' logprobs at every scored position (with return_logprob)
    )
    resume: ResumeState | None = None  # set on a replay after a restart
    priority: int | None = None  # the waiting queue's order with --enable-priority-scheduling
    return_routed_experts: bool = (
        False  # with --enable-return-routed-experts (model_executor/routed_experts.py)
    )
    routed_experts_start_len: int = 0  # the first token whose experts are returned
    lora_path: str | None = None  # the LoRA adapter's name (--lora-paths); None: the base model


@dataclass
class AbortReq:
    rid: str
    reason: str = "aborted by the client"
    status_code: int | None = None  # the HTTP status the client sees (503: a deadline passed)


@dataclass
class FlushCacheReq:
    request_id: str  # echoed in ControlReply
    # SGLang's /hicache/storage-backend/clear: each rank deletes its disk tier's files instead
    storage: bool = False


@dataclass
class ReleaseMemoryReq:
    """The host is short of memory (the front end's reading: srt/memory_watch.py). Every rank, in
    the same iteration, evicts its unlocked prefix cache and gives the free KV pages' memory back
    to the OS. No reply."""

    reason: str


@dataclass
class GetInternalStateReq:
    request_id: str  # echoed in ControlReply


@dataclass
class GetLoadReq:
    """The load a router balances on (GET /get_load, SGLang's shape)."""

    request_id: str  # echoed in ControlReply


@dataclass
class LoadLoraAdapterReq:
    """Load a peft folder as the LoRA adapter `name` (SGLang's /load_lora_adapter). Every rank loads
    its shard in the same iteration; the adapter is usable once every rank succeeded (a MIN over the
    world), else no rank has it (scheduler/lora_registry.py). Answered by a ControlReply."""

    request_id: str  # echoed in ControlReply
    name: str
    path: str
    pinned: bool = False  # SGLang's: never evicted (srt keeps every adapter in memory anyway)


@dataclass
class UnloadLoraAdapterReq:
    """Drop the LoRA adapter `name`: new requests naming it are refused at once, and the ControlReply
    comes once no request running or queued uses it."""

    request_id: str  # echoed in ControlReply
    name: str


@dataclass
class UpdateWeightsFromDiskReq:
    """Load the weights of the safetensors folder `model_path` (SGLang's /update_weights_from_disk).
    Every rank loads its shard into new tensors between steps; the new weights serve only once every
    rank succeeded (a MIN over the world), else every rank keeps the old ones
    (scheduler/weight_registry.py). Answered by a ControlReply."""

    request_id: str  # echoed in ControlReply
    model_path: str
    weight_version: str | None = None  # the version the new weights serve under; None: unchanged


@dataclass
class UpdateWeightVersionReq:
    """Rename the weights' version (SGLang's /update_weight_version). Answered by a ControlReply."""

    request_id: str
    new_version: str


@dataclass
class PauseGenerationReq:
    """Stop running steps until ContinueGenerationReq (SGLang's `in_place` and `retract` modes; its
    `abort` mode is the front end's aborts). `retract` also puts every running request back in the
    waiting queue with its tokens. Answered by a ControlReply."""

    request_id: str
    mode: str  # "in_place" or "retract"


@dataclass
class ContinueGenerationReq:
    """Run steps again after a pause (harmless without one). Answered by a ControlReply."""

    request_id: str


# ---- schedulers (output rank only) -> detokenizer ----


@dataclass
class TokenLogprobs:
    """Log-probabilities of consecutive tokens of one request (prompt or output).

    values[i] is log p(token_ids[i] | the tokens before it), from the log-softmax of the model's
    raw float32 logits; None for the first prompt token (nothing precedes it). top[i] holds the
    top_logprobs_num most likely tokens at that position, as (logprobs, ids), best first, or is
    None when no alternatives were asked for (or for the first prompt token). ids[i] holds the
    logprobs of the request's token_ids_logprob at that position, as (logprobs, ids) in the order
    asked, or None (none asked for, or the first prompt token); empty when none were asked for.
    """

    values: list[float | None]
    token_ids: list[int]
    top: list[tuple[list[float], list[int]] | None]
    ids: list[tuple[list[float], list[int]] | None] = field(default_factory=list)


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id, stop string or stop regex that ended the request
    message: str | None = None  # why an abort happened
    regex: bool = False  # `matched` is a stop_regex pattern (its match is found again in the text)
    status_code: int | None = None  # an abort the client should see as this HTTP status (503: queue full)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop" or self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


@dataclass(frozen=True)
class DecodeSpec:
    """A request's text options, for the detokenizer. Stop strings are matched by the scheduler;
    the detokenizer holds back what could become one and cuts the text there."""

    stop_strings: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the stop string / stop token / stop regex match in the text

    @classmethod
    def of(cls, params: SamplingParams) -> DecodeSpec:
        return cls(
            tuple(params.stop),
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
            params.no_stop_trim,
        )


@dataclass
class BatchTokenIDOut:
    """New output tokens of the requests that advanced this step (or finished)."""

    rids: list[str]
    new_token_ids: list[list[int]]  # tokens since the last message for that rid
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Per request (empty when no request of the message is new to the detokenizer): how to turn its
    # ids into text, sent with the request's first output only.
    decode_specs: list[DecodeSpec | None] = field(default_factory=list)
    # Per request (empty when no request of the message asked for logprobs): the logprobs of
    # new_token_ids, and of the prompt tokens (sent once, with the first output).
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    input_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Per request (empty when no request of the message is a replay's first output): what the
    # client already had, so the restarted detokenizer continues its text.
    resumes: list[ResumeState | None] = field(default_factory=list)
    # Per request (empty when no request of the message asked for them): the experts its tokens
    # were routed to, base64 of int32 [tokens, layers, top_k], with its last message only.
    routed_experts: list[str | None] = field(default_factory=list)
    # Per request (empty unless --is-embedding): its prompt's pooled embedding, with its last message.
    embeddings: list[list[float] | None] = field(default_factory=list)


@dataclass
class ControlReply:
    """Answer to a control request (flush, internal state), passed through by the detokenizer."""

    request_id: str
    success: bool
    payload: dict[str, Any] = field(default_factory=dict)


# ---- detokenizer (or, with --is-embedding, the output rank) -> TokenizerManager ----


@dataclass
class BatchStrOut:
    rids: list[str]
    texts: list[str]  # new text since the last message (never ends inside a UTF-8 character)
    new_token_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # as in BatchTokenIDOut
    input_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    routed_experts: list[str | None] = field(default_factory=list)
    embeddings: list[list[float] | None] = field(default_factory=list)

    @classmethod
    def without_text(cls, out: BatchTokenIDOut) -> BatchStrOut:
        """An --is-embedding server's output, which the output rank sends straight to the
        TokenizerManager (no detokenizer: an embedding has no text)."""
        return cls(
            rids=out.rids,
            texts=[""] * len(out.rids),
            new_token_ids=out.new_token_ids,
            finished_reasons=out.finished_reasons,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            embeddings=out.embeddings,
        )
