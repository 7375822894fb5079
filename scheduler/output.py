"""What a step streams: each request in the outbox with its tokens since it last sent (new ids only:
the detokenizer keeps the rest), and the columns a request of the message asked for (logprobs,
routed experts, embeddings, a replay's resume state, the decode spec with a first output). Only the
output rank builds the message; every rank marks the same tokens sent."""

from __future__ import annotations

from scheduler.logprobs import attach_logprobs
from scheduler.req import Req
from srt.io_struct import BatchTokenIDOut, DecodeSpec


def mark_sent(req: Req) -> None:
    req.sent_len = len(req.output_ids)
    req.resume = None
    req.decode_spec_sent = True


def token_output(reqs: list[Req]) -> BatchTokenIDOut:
    """The message for `reqs`, each marked sent as it is added (a request listed twice sends its
    tokens once)."""
    out = BatchTokenIDOut([], [], [], [], [], [], [])
    with_logprobs = any(req.return_logprob for req in reqs)
    with_resumes = any(req.resume is not None for req in reqs)
    with_specs = not all(req.decode_spec_sent for req in reqs)
    with_routes = any(req.return_routed_experts for req in reqs)
    with_embeddings = any(req.embedding is not None for req in reqs)
    for req in reqs:
        if with_logprobs:
            attach_logprobs(out, req)
        if with_routes:
            out.routed_experts.append(req.routed_experts if req.finished_reason is not None else None)
        if with_embeddings:
            out.embeddings.append(req.embedding)
        if with_resumes:
            out.resumes.append(req.resume)
        out.rids.append(req.rid)
        out.new_token_ids.append(req.output_ids[req.sent_len :])
        out.finished_reasons.append(req.finished_reason)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        if with_specs:
            out.decode_specs.append(None if req.decode_spec_sent else DecodeSpec.of(req.sampling_params))
        mark_sent(req)
    return out
