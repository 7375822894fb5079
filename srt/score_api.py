"""SGLang's POST /v1/score: how likely each label token is to come next after a query and an item.

For each item the prompt is the query's tokens then the item's (`item_first`: the other way round;
a text item is tokenized without special tokens, as it continues the query). Each prompt becomes a
/generate request of one greedy token with `token_ids_logprob` set to the labels, so the prompts
go through the same broadcast, scheduler and batches as any generation; the labels' logprobs at
the first output position (from the raw logits) are the scores:

    apply_softmax false:  exp(logprob) of each label (its probability over the whole vocabulary)
    apply_softmax true:   softmax(logprob / temperature) over the labels alone

`label_token_ids` is one list for every item or one list per item. The answer is SGLang's
ScoringResponse: `scores` [items][labels], `token_logprobs` with `return_token_logprobs`, `model`,
`usage`, `object` "scoring". Fields: SGLang's `ScoringRequest` (sglang 0.5.23); its embedding
overrides, pooled hidden states and setwise `score_extraction_token` are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.generate_parse import RequestError, check_request_fields, is_int, is_token_id
from srt.http_common import OPENAI_ERRORS, batch_outputs, manager, read_json_object
from srt.request_fields import NONE, Field, advisory, impl, off
from srt.request_state import ServiceUnavailableError
from srt.tokenizer_manager import TokenizerManager

router = APIRouter()

SCORE: dict[str, Field] = {
    "query": impl(),
    "items": impl(),
    "label_token_ids": impl(),
    "apply_softmax": impl(False),
    "temperature": impl(1.0),
    "return_token_logprobs": impl(False),
    "item_first": impl(False),
    "model": advisory("default"),
    "embed_override_token_id": NONE,
    "query_embed_overrides": NONE,
    "item_embed_overrides": NONE,
    "return_pooled_hidden_states": off(False),
    "score_extraction_token": NONE,
}


def _ids(tm: TokenizerManager, value: Any, param: str, *, special: bool) -> list[int]:
    if isinstance(value, str):
        return list(tm.tokenizer.encode(value, add_special_tokens=special))
    if isinstance(value, list) and all(is_int(t) for t in value):
        return list(value)
    raise RequestError(f"{param} must be a string or a list of token ids, got {value!r}", param)


def _labels(value: Any, num_items: int, vocab_size: int) -> list[list[int]]:
    """label_token_ids as one list per item."""
    if not isinstance(value, list) or not value:
        raise RequestError(
            "label_token_ids is required: a non-empty list of token ids, or one per item", "label_token_ids"
        )
    per_item = all(isinstance(v, list) for v in value)
    if per_item and len(value) != num_items:
        raise RequestError(f"label_token_ids has {len(value)} lists for {num_items} items", "label_token_ids")
    lists = value if per_item else [value] * num_items
    for labels in lists:
        if (
            not isinstance(labels, list)
            or not labels
            or not all(is_token_id(t, vocab_size) for t in labels)
            or len(set(labels)) != len(labels)
        ):
            raise RequestError(
                f"label_token_ids must hold non-empty lists of distinct token ids in [0, {vocab_size}), got {labels!r}",
                "label_token_ids",
            )
    return [list(labels) for labels in lists]


def scores_of(logprobs: list[float], apply_softmax: bool, temperature: float) -> list[float]:
    """A row of scores from the labels' logprobs (the module doc has the rule)."""
    if not apply_softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)
    weights = [math.exp((x - top) / temperature) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


@router.post("/v1/score")
async def score(request: Request) -> Response:
    tm = manager(request)
    try:
        body = await read_json_object(request)
        check_request_fields(body, SCORE)
        raw_items = body.get("items")
        if raw_items is None or (isinstance(raw_items, list) and not raw_items):
            raise RequestError(
                "items is required: a string, a list of strings or a list of token id lists", "items"
            )
        items = [raw_items] if isinstance(raw_items, str) else raw_items
        if not isinstance(items, list):
            raise RequestError(f"items must be a string or a list, got {raw_items!r}", "items")
        query = body.get("query")
        query_ids = [] if query is None else _ids(tm, query, "query", special=True)
        item_ids = [_ids(tm, item, "items", special=False) for item in items]
        labels = _labels(body.get("label_token_ids"), len(items), int(tm.model_info.get("vocab_size", 0)))
        flags = {
            name: body.get(name, False) for name in ("apply_softmax", "item_first", "return_token_logprobs")
        }
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise RequestError(f"{name} must be a boolean, got {value!r}", name)
        temperature = body.get("temperature", 1.0)
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not (math.isfinite(temperature) and temperature > 0)
        ):
            raise RequestError(
                f"temperature must be a finite number above 0, got {temperature!r}", "temperature"
            )
        if temperature != 1.0 and not flags["apply_softmax"]:
            raise RequestError("temperature applies only with apply_softmax true", "temperature")
        prompts = [item + query_ids if flags["item_first"] else query_ids + item for item in item_ids]
        if any(not prompt for prompt in prompts):
            raise RequestError("a query and item with no tokens leave nothing to score", "items")
        call = tm.parse_generate(
            {
                "input_ids": prompts,
                "return_logprob": True,
                "token_ids_logprob": labels,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
            }
        )
        outs = await batch_outputs(tm.generate(call, request), OPENAI_ERRORS)
    except (ValueError, ServiceUnavailableError) as error:
        return OPENAI_ERRORS.of(error)
    if isinstance(outs, JSONResponse):
        return outs
    logprobs = [[entry[0] for entry in out["meta_info"]["output_token_ids_logprobs"][0]] for out in outs]
    reply: dict[str, Any] = {
        "scores": [scores_of(row, flags["apply_softmax"], float(temperature)) for row in logprobs],
        "model": tm.server_args.model_name,
        "usage": {
            "prompt_tokens": sum(out["meta_info"]["prompt_tokens"] for out in outs),
            "total_tokens": sum(out["meta_info"]["prompt_tokens"] for out in outs),
            "completion_tokens": 0,
        },
        "object": "scoring",
    }
    if flags["return_token_logprobs"]:
        reply["token_logprobs"] = logprobs
    return JSONResponse(reply)
