"""Tool calls on /v1/chat/completions: a tiny Qwen-shaped model (random weights, SmolLM2's
vocabulary) behind a Qwen 2.5 chat template, `--tool-call-parser qwen25`. `tool_choice` required
and a named function always return calls whose arguments match the function's schema (the grammar
sees to it, whatever the weights); the parsers, validation, how a chat template's tool support
is told (and srt's generic tool prompt written where it has none), the grammar's array closing after
each call (one call for a named function) and a repeated call ending the turn, without a server."""

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
from transformers import AutoTokenizer

from model_executor.constrained import LazyGrammarBackend
from srt.generate_parse import RequestError
from srt.sampling_params import GrammarSpec
from srt.tool_calls import NamedTool, plan_tools
from srt.tool_template import calls_text, chat_tools, probe_template

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
        "temperature": 1.0,  # seeded: greedy, the random weights repeat a call, which ends the turn
        "seed": 7,
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
    # one call, parallel calls or not: a random-weight model would otherwise add calls until max_tokens
    reply = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "set_alarm"}},
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [name for name, _ in check_calls(reply.choices[0].message.tool_calls, {"set_alarm"})] == [
        "set_alarm"
    ]


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
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
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
    qwen = plan_tools(TOOLS, "auto", True, "qwen25")
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
    llama = plan_tools(TOOLS, "auto", True, "llama3")
    assert llama is not None
    content, calls = llama.parse(
        '<|python_tag|>{"name": "set_alarm", "parameters": {"hour": 6, "loud": false}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}'
    )
    assert content is None and [c.name for c in calls] == ["set_alarm", "get_weather"]
    assert json.loads(calls[0].arguments) == {"hour": 6, "loud": False}


def test_generic_parser_reads_the_array_after_any_text_and_leaves_other_text_content() -> None:
    plan = plan_tools(TOOLS, "auto", True, "generic")
    assert plan is not None and plan.parses
    content, calls = plan.parse(
        'Let me look.\n[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}]'
    )
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 1})
    ]
    content, calls = plan.parse('[{"name": "set_alarm", "arguments": {"hour": 7, "loud": true}}]')
    assert content is None and [c.name for c in calls] == ["set_alarm"]  # "arguments" is read too
    for text in (
        "It will rain in Oslo tomorrow.",  # no call: all content
        'The cities: [{"name": "Oslo"}, {"name": "Rome"}]',  # an array naming none of the functions
        "See [1] and [2].",
    ):
        assert plan.parse(text) == (text, [])
    assert plan.stream_safe_prefix("Sure. [") == len("Sure. ")
    assert plan.stream_safe_prefix(' [{"name"') == 0  # a reply that opens with a call streams nothing
    assert plan.stream_safe_prefix("No call here") == len("No call here")


def test_the_constrained_output_and_the_generic_prompts_format_agree() -> None:
    # a call written as the generic prompt says (and as past calls are rendered) is valid under
    # the grammar of tool_choice required; and the generic parser reads the constrained output
    required = plan_tools(TOOLS, "required", True, "generic")
    assert required is not None
    past = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "set_alarm", "arguments": {"hour": 7, "loud": True}},
        }
    ]
    jsonschema.validate(json.loads(calls_text(past)), json.loads(required.json_schema() or ""))
    auto = plan_tools(TOOLS, "auto", True, "generic")
    assert auto is not None
    assert auto.parse(calls_text(past))[1] == required.parse(calls_text(past))[1]


# a template that renders tools in a format srt does not know, and one that refuses them
OWN_FORMAT_TEMPLATE = (
    "{%- if tools %}Functions: {{ tools | tojson }}\n{%- endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{%- endfor %}assistant:"
)
REFUSING_TEMPLATE = (
    "{%- if tools %}{{ raise_exception('no tools here') }}{%- endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{%- endfor %}assistant:"
)
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- for t in tools %}{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}"
    "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endfor %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture
def tokenizer_with(smollm2_dir: Path) -> Any:
    def make(template: str | None) -> Any:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        if template is not None:
            tokenizer.chat_template = template
        return tokenizer

    return make


@pytest.mark.parametrize(
    ("template", "renders_tools", "parser"),
    [
        (None, False, "generic"),  # SmolLM2's own: the tools would be dropped
        (QWEN_TEMPLATE, True, "qwen25"),
        (LLAMA3_TEMPLATE, True, "llama3"),
        (OWN_FORMAT_TEMPLATE, True, None),
        (REFUSING_TEMPLATE, False, "generic"),
    ],
)
def test_a_template_is_probed_for_tools_and_its_parser(
    tokenizer_with: Any, template: str | None, renders_tools: bool, parser: str | None
) -> None:
    probed = probe_template(tokenizer_with(template))
    assert (probed.renders_tools, probed.parser) == (renders_tools, parser)


def test_the_parser_comes_from_the_template_unless_the_flag_names_one(tokenizer_with: Any) -> None:
    qwen = tokenizer_with(QWEN_TEMPLATE)
    renders = 0
    apply = qwen.apply_chat_template

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal renders
        renders += 1
        return apply(*args, **kwargs)

    qwen.apply_chat_template = counting
    for _ in range(3):
        found = chat_tools(qwen, None, TOOLS, "auto", True, MESSAGES)
        assert found.plan is not None and found.plan.parser == "qwen25" and found.template_tools == TOOLS
    assert renders == 2  # probed once, with and without a tool
    assert chat_tools(qwen, None, TOOLS, "none", True, MESSAGES).template_tools == TOOLS
    flagged = chat_tools(qwen, "llama3", TOOLS, "auto", True, MESSAGES)
    assert flagged.plan is not None and flagged.plan.parser == "llama3" and flagged.template_tools == TOOLS
    forced = chat_tools(
        qwen, "generic", TOOLS, "auto", True, MESSAGES
    )  # srt's prompt even where the template has one
    assert forced.plan is not None and forced.plan.parser == "generic" and forced.template_tools is None
    assert forced.conversation[0]["role"] == "system" and "get_weather" in forced.conversation[0]["content"]
    with pytest.raises(RequestError, match="--tool-call-parser") as info:  # auto in a format srt cannot read
        chat_tools(tokenizer_with(OWN_FORMAT_TEMPLATE), None, TOOLS, "auto", True, MESSAGES)
    assert info.value.param == "tool_choice"


def test_calls_and_results_render_as_plain_turns_on_a_template_without_tools(tokenizer_with: Any) -> None:
    smollm2 = tokenizer_with(None)
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}
    conversation: Any = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Rain, 9 C"},
        {"role": "tool", "name": "get_weather", "content": "Sun, 14 C"},
    ]
    found = chat_tools(smollm2, None, TOOLS, "auto", True, conversation)
    assert found.plan is not None and found.plan.parser == "generic" and found.template_tools is None
    text = smollm2.apply_chat_template(found.conversation, tokenize=False, add_generation_prompt=True)
    system, user, assistant, results, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\nBe brief.\n\nYou can call these functions")
    assert json.dumps(TOOLS[0]["function"]) in system and '"parameters": {<arguments' in system
    assert (
        assistant
        == 'assistant\n[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}]<|im_end|>\n'
    )
    assert results == (
        "user\nFunction results:\nget_weather returned: Rain, 9 C\nget_weather returned: Sun, 14 C<|im_end|>\n"
    )
    assert prompt == "assistant\n"
    # tool_choice none: the history still renders, with no tools prompt
    none = chat_tools(smollm2, None, TOOLS, "none", True, conversation)
    assert none.conversation[0] == {"role": "system", "content": "Be brief."}
    assert len(none.conversation) == 4 and "tool_calls" not in none.conversation[2]


@pytest.mark.parametrize(
    "choice,parser,text",
    [
        (
            "required",
            "qwen25",
            '[{"name":"get_weather","parameters":{"city":"Oslo","days":2}}, '
            '{"name":"set_alarm","parameters":{"hour":7,"loud":true}}]',
        ),
        (
            "auto",
            "generic",
            'Let me check. [{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}, '
            '{"name": "set_alarm", "parameters": {"hour": 6, "loud": false}}]',
        ),
        (
            "auto",
            "qwen25",
            'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n'
            '</tool_call>\n<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 6, "loud": false}}\n</tool_call>',
        ),
    ],
)
def test_calls_complete_in_a_partial_output_are_the_finished_outputs_first(
    choice: str, parser: str, text: str
) -> None:
    plan = plan_tools(TOOLS, choice, True, parser)
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
    assert plan_tools([], "none", True, None) is None
    with pytest.raises(RequestError, match="--tool-call-parser") as info:
        plan_tools(TOOLS, "auto", True, None)  # auto needs a parser
    assert info.value.param == "tool_choice"
    required = plan_tools(TOOLS, "required", False, None)
    assert required is not None and required.constrained
    schema = json.loads(required.json_schema() or "")
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    with pytest.raises(RequestError) as info:
        plan_tools(TOOLS + TOOLS[:1], "auto", True, "qwen25")
    assert info.value.param == "tools"


CALL_TEXTS = [  # a required array's calls as the model writes them; the third repeats the first
    '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}',
    ', {"name": "set_alarm", "parameters": {"hour": 7, "loud": true}}',
    ',\n{"name": "get_weather", "parameters": {"city":"Oslo","days":1}}',  # the same arguments
    ', {"name": "set_alarm", "parameters": {"hour": 8, "loud": true}}',
]


def accepts(grammars: LazyGrammarBackend, tokenizer: Any, schema: str, text: str) -> bool:
    """Whether the grammar of `schema` takes `text` (as the model's tokens), then the end of the output."""
    matcher = grammars.new_matcher(GrammarSpec("json_schema", schema))
    tokens = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return all(matcher.accept(token) for token in tokens) and matcher.terminated


def test_the_grammar_closes_after_each_call_and_a_named_function_allows_one(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    grammars = LazyGrammarBackend("xgrammar", lambda: tokenizer, 49152, {tokenizer.eos_token_id})
    required = plan_tools(TOOLS, "required", True, None)
    named = plan_tools(TOOLS, NamedTool("set_alarm"), True, None)
    assert required is not None and named is not None and named.parallel  # parallel_tool_calls' default
    schema, one = required.json_schema() or "", named.json_schema() or ""
    for count in range(1, len(CALL_TEXTS) + 1):  # the array may close after every complete call
        assert accepts(grammars, tokenizer, schema, "".join(CALL_TEXTS[:count]) + "]")
    alarm = '[{"name": "set_alarm", "parameters": {"hour": 7, "loud": true}}'
    assert accepts(grammars, tokenizer, one, alarm + "]")
    assert not accepts(grammars, tokenizer, one, alarm + CALL_TEXTS[1] + "]")
    assert not accepts(grammars, tokenizer, one, CALL_TEXTS[0] + "]")


@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_call_ends_the_turn_with_the_calls_before_it(stream: bool) -> None:
    import asyncio

    from srt.conversation.call import ChatCall
    from srt.conversation.reply import ReplyReader
    from srt.repeated_calls import REPEAT_REASON, end_at_repeated_call

    plan = plan_tools(TOOLS, "required", True, None)
    assert plan is not None and plan.ends_at_repeat
    call = ChatCall({}, stream, {}, tools=plan)
    texts = ["".join(CALL_TEXTS[:count]) for count in range(1, len(CALL_TEXTS) + 1)]
    read: list[str] = []
    aborts: list[tuple[str, str]] = []

    async def outputs() -> Any:  # a request that would run on: never finished
        for text in texts:
            read.append(text)
            yield {"text": text, "meta_info": {"id": "r", "finish_reason": None}}

    async def abort(rid: str, reason: str) -> None:
        aborts.append((rid, reason))

    async def collect() -> list[dict[str, Any]]:
        return [out async for out in end_at_repeated_call(call, outputs(), abort)]

    outs = asyncio.run(collect())
    assert aborts == [("r", REPEAT_REASON)] and read == texts[:3]  # ended at the repeat, read no further
    assert len(outs) == (3 if stream else 1)
    last = outs[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
    assert last["text"] == "".join(CALL_TEXTS[:2])  # the output before the repeat
    reply = ReplyReader(plan).read(last, whole=True)
    assert reply.finish_reason == "tool_calls" and reply.content is None
    assert [c.name for c in reply.tool_calls] == ["get_weather", "set_alarm"]
    assert plan.repeat_start(texts[1]) is None and plan.repeat_start(texts[3]) == len(texts[1])
    # a named function or no parallel calls: one call, nothing to watch
    for choice, parallel in (("required", False), (NamedTool("set_alarm"), True)):
        single = plan_tools(TOOLS, choice, parallel, None)
        assert single is not None and not single.ends_at_repeat


def test_auto_streams_content_until_a_call_begins_then_the_calls() -> None:
    import asyncio

    from srt.openai_api import stream_chunks
    from srt.openai_parse import OpenAICall

    plan = plan_tools(TOOLS, "auto", True, "qwen25")
    call = OpenAICall({}, True, {}, tools=plan)
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


def test_each_api_reads_its_tools_and_tool_choice_into_the_same_typed_request() -> None:
    """A named tool, `required` (Anthropic's `any`) and serial calls, each in its API's words: one
    typed request, and errors named by the client's own paths."""
    from srt import anthropic_parse, openai_parse, responses_parse

    function = TOOLS[0]["function"]
    ask = [{"role": "user", "content": "Will it rain in Oslo tomorrow?"}]
    cases = [
        (
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "name": "get_weather"},
            NamedTool("get_weather"),
        ),
        ("required", {"type": "any"}, "required", "required"),
    ]
    for openai_choice, anthropic_choice, responses_choice, typed in cases:
        for parallel in (True, False):
            requests = [
                openai_parse.chat_request(
                    {
                        "messages": ask,
                        "tools": [{"type": "function", "function": function}],
                        "tool_choice": openai_choice,
                        "parallel_tool_calls": parallel,
                    }
                ),
                anthropic_parse.chat_request(
                    {
                        "messages": ask,
                        "tools": [{"name": function["name"], "input_schema": function["parameters"]}],
                        "tool_choice": {**anthropic_choice, "disable_parallel_tool_use": not parallel},
                    }
                ),
                responses_parse.chat_request(
                    {
                        "input": ask,
                        "tools": [{"type": "function", "name": function["name"], "parameters": WEATHER}],
                        "tool_choice": responses_choice,
                        "parallel_tool_calls": parallel,
                    },
                    [],
                )[0],
            ]
            for request in requests:
                assert request.tool_choice == typed and request.parallel_tool_calls is parallel
                assert [(t.name, t.parameters) for t in request.tools] == [("get_weather", WEATHER)]
                assert request.conversation == requests[0].conversation
    refusals = [
        (lambda: openai_parse.chat_request({"messages": ask, "tool_choice": "sometimes"}), "tool_choice"),
        (
            lambda: anthropic_parse.chat_request({"messages": ask, "tool_choice": {"type": "x"}}),
            "tool_choice",
        ),
        (
            lambda: responses_parse.chat_request({"input": ask, "parallel_tool_calls": 1}, []),
            "parallel_tool_calls",
        ),
        (
            lambda: anthropic_parse.chat_request({"messages": ask, "tools": [{"name": "f"}]}),
            "tools[0].input_schema",
        ),
    ]
    for refused, path in refusals:
        with pytest.raises(RequestError) as info:
            refused()
        assert info.value.param == path, (path, str(info.value))
