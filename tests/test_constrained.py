"""Structured outputs on SmolLM2 (the default path, bf16, one server for the module): JSON schemas that validate,
regexes that full-match, an EBNF grammar whose outputs parse, the official openai client's
response_format (streaming too), and bad grammars as 400s naming their parameter. Plus the parts
without a server: the sampler's bitmask, matcher rebuilds (retraction, replay), the front end's
validation."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from server_fixture import Server
from transformers import AutoTokenizer

from model_executor.constrained import GrammarError, GrammarSpec, LazyGrammarBackend
from model_executor.logits_processor import fill_bitmask
from model_executor.sampler import apply_token_bitmask
from scheduler.grammar import advance, attach_matcher, rebuild_matcher
from scheduler.req import Req
from srt.sampling_params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["tags", "ok"],
    "additionalProperties": False,
}
SCORES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "level": {"enum": ["low", "mid", "high"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["level", "score"],
        "additionalProperties": False,
    },
    "minItems": 2,
    "maxItems": 2,
}
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]? | "(" expr ")"
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server(
        "--max-total-tokens",
        "4096",
        "--max-running-requests",
        "8",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def generate(server: Server, texts: list[str], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    resp = server.generate({"text": texts, "sampling_params": [{"temperature": 0, **p} for p in params]})
    assert resp.status_code == 200, resp.text
    return list(resp.json())


@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_json_schema_outputs_validate(server: Server) -> None:
    schemas = [PERSON, TAGS, SCORES]
    outs = generate(
        server,
        ["Describe a user of a website as JSON:", "Tag this photo of a beach:", "Rate two risks:"],
        [{"max_new_tokens": 96, "json_schema": json.dumps(s)} for s in schemas],
    )
    for schema, out in zip(schemas, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_a_bounded_schema_always_closes_under_the_default_whitespace(server: Server) -> None:
    """With the default --constrained-json-max-whitespace-cnt, prompts that lead the bundled model to
    emit newline after newline between tokens (unbounded, 2 of these 7 ran to the token limit) still
    close a schema whose strings and arrays are bounded: every output, greedy and seeded, parses and
    ends with stop well before the limit."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["name", "tags"],
    }
    prompts = ["Name:\n\n", "{\n\n", "List\n\n\n", "The name is\n", "\n\n\n\n", "Hello", "Tags:\n\n- a\n\n"]
    sampled = [
        {"temperature": 0},
        {"temperature": 1.0, "sampling_seed": 1},
        {"temperature": 1.0, "sampling_seed": 2},
    ]
    params = [
        {"max_new_tokens": 400, "json_schema": json.dumps(schema), **s} for s in sampled for _ in prompts
    ]
    outs = generate(server, prompts * len(sampled), params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"][:80]
        assert out["meta_info"]["completion_tokens"] < 200, out["text"][:80]
        jsonschema.validate(json.loads(out["text"]), schema)


@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_regex_outputs_full_match(server: Server) -> None:
    patterns = [r"(red|green|blue)-[0-9]{2}", r"[A-Z][a-z]{2,8} [0-9]{4}", r"\d{3}-\d{3}-\d{4}"]
    outs = generate(
        server,
        ["Pick a colour code:", "A month and a year:", "Call me at"],
        [{"max_new_tokens": 24, "regex": p} for p in patterns],
    )
    for pattern, out in zip(patterns, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])


@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_ebnf_outputs_parse(server: Server) -> None:
    outs = generate(
        server,
        ["Write an arithmetic expression:", "2 + 2 is the same as"],
        [{"max_new_tokens": 24, "ebnf": ARITHMETIC, "temperature": 0.8, "seed": 3}] * 2,
    )
    for out in outs:
        text = out["text"]
        if out["meta_info"]["finish_reason"]["type"] == "length":
            continue  # a long expression cut short: nothing to parse; the next must
        tree = ast.parse(text, mode="eval")
        assert all(
            isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.operator)) for n in ast.walk(tree)
        ), text
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs), outs


@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_openai_response_format_json_schema_chat_and_stream(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS, "strict": True}}
    messages: Any = [{"role": "user", "content": "Tag a photo of a cat as JSON."}]
    reply = client.chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=64, response_format=fmt
    )
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), TAGS)
    chunks = client.chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=64, response_format=fmt, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == content


@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_openai_json_object_on_completions(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="m",
        prompt="A JSON object describing a dog:",
        temperature=0,
        max_tokens=48,
        extra_body={"response_format": {"type": "json_object"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.text), dict)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"regex": "([a-z"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": json.dumps({"type": "nope"})}, "json_schema"),
        ({"json_schema": {"type": "object"}}, "json_schema"),  # SGLang's field is the schema serialized
        ({"ebnf": "root ::= missing_rule"}, "ebnf"),
        ({"structural_tag": '{"type": "structural_tag", "format": {"type": "what"}}'}, "structural_tag"),
        ({"regex": "a+", "json_schema": '{"type": "object"}'}, "regex"),
    ],
)
@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_bad_grammars_are_400s_naming_the_parameter(
    server: Server, params: dict[str, Any], param: str
) -> None:
    resp = server.generate({"text": "hello", "sampling_params": {"max_new_tokens": 4, **params}})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


@pytest.mark.slow  # one server, ~40 s: the slow tier keeps the default run under 20 minutes
def test_bad_response_formats_are_400s_and_the_server_keeps_serving(
    server: Server, client: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"}},
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=messages, max_tokens=4, response_format=fmt)  # type: ignore[arg-type]
        assert isinstance(info.value.body, dict) and info.value.body.get("param") == "response_format"
    out = generate(server, ["Count:"], [{"max_new_tokens": 6, "regex": "[0-9]+"}])[0]
    assert re.fullmatch("[0-9]+", out["text"]), out


# ---- without a server ----


def test_bitmask_masks_exactly_the_forbidden_tokens() -> None:
    logits = torch.randn(3, 70)
    bitmask = torch.full((3, 3), -1, dtype=torch.int32)
    bitmask[1] = torch.tensor(
        [1 << 5, 0, (1 << 3) | -(2**31)]
    )  # tokens 5 and 67; bit 31 (95) is past the vocabulary
    bitmask[2] = 0  # forbids everything, but row 2 is not constrained
    out = logits.clone()
    apply_token_bitmask(out, bitmask, [1])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5, 67]
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])


def test_the_backends_kernel_masks_as_the_sampler_does(grammars: LazyGrammarBackend) -> None:
    backend = grammars.get("regex")
    logits = torch.randn(5, 49152)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 1536), dtype=torch.int32)
    reference, kernel = logits.clone(), logits.clone()
    apply_token_bitmask(reference, bitmask, [0, 3, 4])
    backend.apply_bitmask_inplace(kernel, bitmask, [0, 3, 4])
    assert torch.equal(torch.isinf(reference), torch.isinf(kernel)) and torch.equal(reference, kernel)
    assert torch.equal(kernel[1], logits[1])


@pytest.fixture(scope="module")
def grammars(smollm2_dir: Path) -> LazyGrammarBackend:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return LazyGrammarBackend("xgrammar", lambda: tokenizer, 49152, {tokenizer.eos_token_id})


def test_a_retracted_or_replayed_matcher_is_rebuilt_from_the_delivered_tokens(
    grammars: LazyGrammarBackend, smollm2_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer("red-42", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=16, regex=r"(red|green)-[0-9]{2}")
    live = Req("a", [1, 2], params, seed=0)
    assert attach_matcher(grammars, live) is None and live.grammar is not None
    for token in text:
        live.output_ids.append(token)
        assert advance(live, token) is None
    replay = Req("b", [1, 2], params, seed=0, output_ids=list(text), resumed_len=len(text))
    assert attach_matcher(grammars, replay) is None and replay.grammar is not None
    assert replay.grammar.state == live.grammar.state == (len(text), False)
    masks = [fill_bitmask([r.grammar], [0], 49152) for r in (live, replay)]
    assert torch.equal(masks[0], masks[1])  # only the stop token is left
    rebuild_matcher(live)
    assert live.grammar.state == (len(text), False)
    assert advance(live, tokenizer.eos_token_id) is not None  # the stop token ends it: finish_reason stop
    assert live.grammar.terminated
    blue = tokenizer("blue", add_special_tokens=False)["input_ids"]
    bad = Req("c", [1, 2], params, seed=0, output_ids=blue, resumed_len=len(blue))
    reason = attach_matcher(grammars, bad)
    assert reason is not None and reason.type == "abort" and "regex" in (reason.message or "")


def test_grammar_params_are_validated_where_they_are_built(grammars: LazyGrammarBackend) -> None:
    assert SamplingParams(regex="").grammar is None  # as SGLang: empty is none
    assert SamplingParams(ebnf='root ::= "a"').grammar == GrammarSpec("ebnf", 'root ::= "a"')
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(GrammarError) as info:
        grammars.compile(GrammarSpec("regex", "(("))
    assert info.value.param == "regex"
    with pytest.raises(GrammarError, match="--grammar-backend none"):
        LazyGrammarBackend("none", lambda: None, 10, ()).compile(GrammarSpec("regex", "a"))
