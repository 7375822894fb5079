"""Constrained requests on a rank: matchers built when a request's message is applied, masks
filled before sampling, tokens accepted after it (model_executor/constrained holds the backends).

Every rank does all of it identically, from the same broadcast messages and the same sampled ids:
- a matcher is built synchronously while the request's message is applied, so every rank holds
  it ready in the same iteration (readiness is never a rank's own timing);
- a step whose batch holds a constrained request MIN-all-reduces its sampled ids over TP
  (Scheduler._sample), so a rank whose logits differ in the last bit cannot lead its matcher
  astray;
- each accepted token records (rid, tokens accepted, terminated) for the consensus checker;
- retraction and replay rebuild the matcher from the output ids already delivered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import consensus
from model_executor.constrained import GrammarError, LazyGrammarBackend, bitmask_words
from scheduler.req import Req
from srt.io_struct import FinishReason


def attach_matcher(grammars: LazyGrammarBackend, req: Req) -> FinishReason | None:
    """Gives `req` its matcher, advanced past its output ids (a replay's); an abort when the grammar
    cannot be built (the front end compiled it already, so every rank fails the same way, if ever)."""
    spec = req.sampling_params.grammar
    if spec is None:
        return None
    try:
        req.grammar = grammars.new_matcher(spec, req.output_ids)
    except (GrammarError, RuntimeError) as error:
        return FinishReason("abort", status_code=400, message=f"{spec.kind}: {error}")
    consensus.record("grammar", (req.rid, *req.grammar.state))
    return None


def rebuild_matcher(req: Req) -> None:
    """After a retraction: the matcher again from the grammar's start and the delivered tokens."""
    if req.grammar is not None:
        req.grammar.rebuild(req.output_ids)
        consensus.record("grammar", (req.rid, *req.grammar.state))


def constrained_rows(reqs: Sequence[Req]) -> list[int]:
    return [i for i, req in enumerate(reqs) if req.grammar is not None]


def fill_bitmask(reqs: Sequence[Req], rows: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[len(reqs), ceil(vocab / 32)] int32: the tokens each of `rows` may take next (the other
    rows allow everything)."""
    bitmask = torch.full((len(reqs), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i in rows:
        grammar = reqs[i].grammar
        assert grammar is not None
        grammar.fill_bitmask(bitmask, i)
    return bitmask


def advance(req: Req, token: int, skip: bool = False) -> FinishReason | None:
    """Accepts `req`'s new token: "stop" once the grammar has terminated (its stop token, such as
    EOS, accepted: nothing may follow), an abort if the grammar refuses the token (every allowed
    token was banned, e.g. by min_new_tokens). `skip` (fault injection) leaves the matcher behind."""
    grammar = req.grammar
    if grammar is None:
        return None
    accepted = skip or grammar.accept(token)
    consensus.record("grammar", (req.rid, *grammar.state))
    if not accepted:
        return FinishReason(
            "abort",
            message=f"the grammar ({req.sampling_params.grammar.kind}) refused "  # type: ignore[union-attr]
            f"token {token}",
        )
    if grammar.terminated:
        return FinishReason("stop", matched=token)
    return None
