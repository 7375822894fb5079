"""Logprobs in the scheduler: which rows a step scores, and recording what comes back per request.

Every rank computes the same LogprobPlan from shared state (the LM head that turns its rows
into logits is a TP collective), but only the output rank has the runner take the log-softmax, and
records values: nothing is decided from them. A step in which no request asked costs one `any()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_executor.forward_batch import ForwardMode
from model_executor.logprobs import TopLogprobs
from model_executor.sampling_inputs import LogprobRows, ScoredTokens
from scheduler.req import Req
from scheduler.schedule_batch import ScheduleBatch
from srt.io_struct import BatchTokenIDOut, TokenLogprobs


@dataclass
class PromptSpan:
    req_index: int  # in the batch
    first_position: int  # prompt position of the first row: it scores token first_position + 1
    count: int


@dataclass
class LogprobPlan:
    rows: LogprobRows  # what the runner scores
    spans: list[PromptSpan]  # which request each run of rows.token_rows belongs to, in order


def plan_logprobs(batch: ScheduleBatch, compute: bool) -> LogprobPlan | None:
    """None when no request of the batch asked for logprobs. `compute`: this rank records them
    (the output rank); the others still pass the rows to the forward. Call before the step moves
    the requests' kv_len."""
    if not any(req.return_logprob for req in batch.reqs):
        return None
    rows: list[int] = []
    spans: list[PromptSpan] = []
    offset = 0  # where request i's new tokens start in the flattened step
    for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
        if batch.forward_mode is ForwardMode.EXTEND:
            wanted = req.prompt_logprob_positions
            # This step computes positions kv_len .. kv_len + n - 1 of the request.
            first, stop = max(wanted.start, req.kv_len), min(wanted.stop, req.kv_len + n)
            if first < stop:
                rows.extend(range(offset + first - req.kv_len, offset + stop - req.kv_len))
                spans.append(PromptSpan(i, first, stop - first))
        offset += n
    sampled = [i for i, req in enumerate(batch.reqs) if req.return_logprob and samples_a_token(batch, i)]
    top_nums = [batch.reqs[i].top_logprobs_num for i in sampled]
    id_lists = [batch.reqs[i].token_ids_logprob for i in sampled]
    targets: list[int] = []
    for span in spans:
        req = batch.reqs[span.req_index]
        targets += req.origin_input_ids[span.first_position + 1 : span.first_position + 1 + span.count]
        top_nums += [req.top_logprobs_num] * span.count
        id_lists += [req.token_ids_logprob] * span.count
    if not any(id_lists):
        id_lists = []
    return LogprobPlan(LogprobRows(rows, targets, sampled, top_nums, compute, id_lists), spans)


def samples_a_token(batch: ScheduleBatch, i: int) -> bool:
    """Whether request i gets an output token this step (a prompt scored with max_new_tokens=0,
    only for its prompt logprobs, completes without one)."""
    return batch.samples(i) and batch.reqs[i].sampling_params.max_new_tokens > 0


def record_logprobs(batch: ScheduleBatch, plan: LogprobPlan, scored: ScoredTokens) -> None:
    """Appends a step's scored tokens to the requests: each sampled row's, then each prompt span's."""
    values, targets, tops = scored.values, scored.token_ids, scored.tops
    ids = scored.ids or [None] * len(values)
    sampled = plan.rows.sampled_rows
    for k, i in enumerate(sampled):
        _append(
            batch.reqs[i].output_logprobs,
            values[k : k + 1],
            targets[k : k + 1],
            tops[k : k + 1],
            ids[k : k + 1],
        )
    k = len(sampled)
    for span in plan.spans:
        end = k + span.count
        _append(
            batch.reqs[span.req_index].input_logprobs, values[k:end], targets[k:end], tops[k:end], ids[k:end]
        )
        k = end


def _append(
    into: TokenLogprobs,
    values: list[float],
    token_ids: list[int],
    tops: list[TopLogprobs | None],
    ids: list[TopLogprobs | None],
) -> None:
    into.values.extend(values)
    into.token_ids.extend(token_ids)
    into.top.extend(tops)
    into.ids.extend(ids)


def attach_logprobs(out: BatchTokenIDOut, req: Req) -> None:
    """Add req's logprobs not sent yet to `out` (call before req.sent_len moves): its new output
    tokens', and with its first message its prompt's. None for what it did not ask for."""
    if not req.return_logprob:
        out.output_logprobs.append(None)
        out.input_logprobs.append(None)
        return
    # Those of the tokens this message sends: a replay's first ones were sent already, and a pipeline
    # stage records a token's logprob at launch, before the token itself is appended.
    lp, start, end = (
        req.output_logprobs,
        req.sent_len - req.resumed_len,
        len(req.output_ids) - req.resumed_len,
    )
    out.output_logprobs.append(
        TokenLogprobs(lp.values[start:end], lp.token_ids[start:end], lp.top[start:end], lp.ids[start:end])
    )
    out.input_logprobs.append(
        _prompt_logprobs(req) if req.logprob_start_len >= 0 and req.sent_len == 0 else None
    )


def _prompt_logprobs(req: Req) -> TokenLogprobs:
    """All prompt logprobs from logprob_start_len on; the first prompt token has none (null)."""
    lp = req.input_logprobs
    if req.logprob_start_len > 0:
        return TokenLogprobs(list(lp.values), list(lp.token_ids), list(lp.top), list(lp.ids))
    head = req.origin_input_ids[:1]
    return TokenLogprobs([None, *lp.values], head + lp.token_ids, [None, *lp.top], [None, *lp.ids])
