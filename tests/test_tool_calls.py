"""Tool calls on /v1/chat/completions: a tiny Qwen-shaped model (random weights, SmolLM2's
vocabulary) behind a Qwen 2.5 chat template, `--tool-call-parser qwen25`. `tool_choice` required
and a named function always return calls whose arguments match the function's schema (the grammar
sees to it, whatever the weights); the parsers and validation without a server."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from server_fixture import Server
from tiny_models import make_tiny_model

from srt.generate_parse import RequestError
from srt.tool_calls import plan_tools

# Qwen 2.5's template, shortened (its tool block and turns as the model was trained on them)
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{%- else %}You are a helpful assistant."
    "{%- endif %}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n{{ message.content or '' }}"
    '{%- for call in message.tool_calls %}\n<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
    "required": ["hour", "loud"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
MESSAGES: Any = [{"role": "user", "content": "Will it rain in Oslo tomorrow?"}]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    model = make_tiny_model("qwen2_smollm2_vocab", tmp_path_factory.mktemp("tiny") / "qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


@pytest.fixture(scope="module")
def client(qwen_dir: Path) -> Iterator[openai.OpenAI]:
    with Server(
        "--model-path",
        str(qwen_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
        "--tool-call-parser",
        "qwen25",
        "--constrained-json-disable-any-whitespace",
    ) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def check_calls(calls: Any, names: set[str]) -> list[tuple[str, str]]:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in calls]


def test_required_returns_calls_matching_the_schema_streaming_too(client: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": "m",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 64,
    }
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert len(calls) == 1
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content  # the constrained array is never content
        for call in delta.tool_calls or []:
            entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == calls


def test_parallel_calls_stream_each_as_soon_as_it_is_complete(client: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": "m",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 96,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = check_calls(whole.message.tool_calls, set(SCHEMAS))  # cut short by max_tokens: the complete calls
    arrivals: list[tuple[int, bool]] = []  # (call index, did the output end in this chunk)
    streamed: dict[int, tuple[str, str]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index not in streamed, "a call was sent twice"
            streamed[call.index] = (call.function.name, call.function.arguments)
            arrivals.append((call.index, chunk.choices[0].finish_reason is not None))
    assert [streamed[i] for i in sorted(streamed)] == calls
    assert len(calls) >= 2 and not arrivals[0][1], arrivals  # the first call came while the output ran on


def test_auto_parses_the_models_own_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    # a random-weight model does not call tools by itself: a regex makes it write Qwen's format
    regex = (
        r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)", '
        r'"days": [1-7]\}\}\n</tool_call>'
    )
    kwargs: Any = {
        "model": "m",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 64,
        "extra_body": {"regex": regex},
    }
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.", choice
    calls = check_calls(choice.message.tool_calls, {"get_weather"})
    content, streamed = "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        streamed += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
    assert "<" not in content and content.strip() == "Sure." and streamed == calls


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    # one call: with parallel calls a random-weight model may add calls until max_tokens
    reply = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "set_alarm"}},
        parallel_tool_calls=False,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    assert {name for name, _ in check_calls(reply.choices[0].message.tool_calls, {"set_alarm"})} == {
        "set_alarm"
    }


def test_tools_are_rendered_by_the_chat_template(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert plain.usage is not None and with_tools.usage is not None
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert with_tools.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_parameter(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, **kwargs)
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == param, info.value.body


# ---- without a server ----


def test_qwen25_and_llama3_parsers() -> None:
    qwen = plan_tools({"tools": TOOLS}, "qwen25")
    assert qwen is not None
    content, calls = qwen.parse(
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
        '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "set_alarm", "arguments": '
        '{"hour": 7, "loud": true}}\n</tool_call>'
    )
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": 2}),
        ("set_alarm", {"hour": 7, "loud": True}),
    ]
    assert qwen.parse("no call here") == ("no call here", [])
    assert qwen.stream_safe_prefix("Hello <tool_") == len("Hello ")
    assert qwen.stream_safe_prefix("Hello <tool_call>{") == len("Hello ")
    assert qwen.stream_safe_prefix("Hello there") == len("Hello there")
    llama = plan_tools({"tools": TOOLS}, "llama3")
    assert llama is not None
    content, calls = llama.parse(
        '<|python_tag|>{"name": "set_alarm", "parameters": {"hour": 6, "loud": false}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}'
    )
    assert content is None and [c.name for c in calls] == ["set_alarm", "get_weather"]
    assert json.loads(calls[0].arguments) == {"hour": 6, "loud": False}


@pytest.mark.parametrize(
    "choice,text",
    [
        (
            "required",
            '[{"name":"get_weather","parameters":{"city":"Oslo","days":2}}, '
            '{"name":"set_alarm","parameters":{"hour":7,"loud":true}}]',
        ),
        (
            "auto",
            'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n'
            '</tool_call>\n<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 6, "loud": false}}\n</tool_call>',
        ),
    ],
)
def test_calls_complete_in_a_partial_output_are_the_finished_outputs_first(choice: str, text: str) -> None:
    plan = plan_tools({"tools": TOOLS, "tool_choice": choice}, "qwen25")
    assert plan is not None
    finished = plan.parse(text)[1]
    assert [c.name for c in finished] == ["get_weather", "set_alarm"]
    seen: list[Any] = []
    for end in range(len(text) + 1):  # the output as a stream sees it, a character at a time
        complete = plan.complete_calls(text[:end])
        assert complete[: len(seen)] == seen and complete == finished[: len(complete)], text[:end]
        seen = complete
    assert plan.complete_calls(text[: text.index("set_alarm")]) == finished[:1]


def test_tool_plans_are_validated() -> None:
    assert plan_tools({"tools": [], "tool_choice": "none"}, None) is None
    with pytest.raises(RequestError, match="--tool-call-parser") as info:
        plan_tools({"tools": TOOLS}, None)  # auto needs a parser
    assert info.value.param == "tool_choice"
    required = plan_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, None)
    assert required is not None and required.constrained
    schema = json.loads(required.json_schema() or "")
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    with pytest.raises(RequestError) as info:
        plan_tools({"tools": TOOLS + TOOLS[:1]}, "qwen25")
    assert info.value.param == "tools"


def test_auto_streams_content_until_a_call_begins_then_the_calls() -> None:
    import asyncio

    from srt.openai_api import stream_chunks
    from srt.openai_parse import OpenAICall

    plan = plan_tools({"tools": TOOLS}, "qwen25")
    call = OpenAICall(True, {}, True, False, {}, tools=plan)
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>'
    cuts = [5, 14, 16, 40, len(text)]

    async def outputs() -> Any:
        for i, cut in enumerate(cuts):
            finish = {"type": "stop", "matched": 2} if i == len(cuts) - 1 else None
            yield {"text": text[:cut], "meta_info": {"id": "x", "finish_reason": finish}}

    async def collect() -> list[dict[str, Any]]:
        return [
            json.loads(c[6:])
            for c in [chunk async for chunk in stream_chunks(call, outputs(), "m")]
            if c.startswith(b"data: {")
        ]

    chunks = asyncio.run(collect())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert (
        "".join(d.get("content") or "" for d in deltas).rstrip() == "Let me check."
    )  # the space went out before the call
    assert all("tool_calls" not in d for d in deltas[:-1])
    (tool_call,) = deltas[-1]["tool_calls"]
    assert tool_call["index"] == 0 and tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Oslo", "days": 1}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
