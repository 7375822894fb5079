"""Constrained requests on a rank: matchers built when a request's message is applied, tokens
accepted as they are appended (model_executor/constrained holds the backends; the runner fills
and applies the masks below the line, model_executor/logits_processor.py).

Every rank does all of it identically, from the same broadcast messages and the same sampled ids:
- a matcher is built synchronously while the request's message is applied, so every rank holds
  it ready in the same iteration (readiness is never a rank's own timing);
- a step whose batch holds a constrained request MIN-all-reduces its sampled ids over TP
  (Scheduler._sampling_inputs), so a rank whose logits differ in the last bit cannot lead its matcher
  astray;
- each accepted token records (rid, tokens accepted, terminated) for the consensus checker;
- retraction and replay rebuild the matcher from the output ids already delivered.
"""

from __future__ import annotations

import consensus
from model_executor.constrained import GrammarError, LazyGrammarBackend, Matcher
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


def draft_matchers(req: Req, draft: list[int]) -> tuple[list[int], list[Matcher]]:
    """A constrained request's drafts as far as its grammar allows them, and the matcher of each
    draft's row (forks of its own, each past the drafts before it); its own matcher is untouched.
    A draft that the grammar refuses, or after which it has terminated, ends the drafts before it."""
    matcher = req.grammar
    if matcher is None:
        return draft, []
    forks: list[Matcher] = []
    for j, token in enumerate(draft):
        matcher = matcher.fork()
        if not matcher.accept(token) or matcher.terminated:
            return draft[:j], forks
        forks.append(matcher)
    return draft, forks


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
