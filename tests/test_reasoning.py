"""`--reasoning-parser` on /v1/chat/completions: a reasoning model's `<think>...</think>` comes back as
`reasoning_content`, the rest as `content`, whole and streamed. A random-weight model does not
think, so a regex makes it write the tags (the grammar sees to it, whatever the weights); the split
itself is checked without a server too, token by token."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from server_fixture import Server
from tiny_models import make_tiny_model

from srt.cli_args import parse_server_args
from srt.reasoning import ReasoningSplit
from srt.server_args import ServerArgs

THINKING = r"<think>[a-z]{4,10}( [a-z]{4,10}){1,3}</think>\n[A-Z]{3,8}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Server]:
    model = make_tiny_model("llama_smollm2_vocab", tmp_path_factory.mktemp("tiny") / "llama")
    with Server(
        "--model-path",
        str(model),
        "--tokenizer-path",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
        "--reasoning-parser",
        "deepseek-r1",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Think, then answer."}],
        temperature=0,
        max_tokens=64,
        extra_body={"regex": THINKING, **extra},
        stream=extra.pop("stream", False),
    )


def _stream(client: openai.OpenAI, **extra: Any) -> tuple[list[str], str]:
    reasoning, content = [], ""
    for chunk in client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Think, then answer."}],
        temperature=0,
        max_tokens=64,
        stream=True,
        extra_body={"regex": THINKING, **extra},
    ):
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            reasoning.append(delta.reasoning_content)
        content += delta.content or ""
    return reasoning, content


def test_reasoning_is_split_from_the_answer_whole_and_streamed(client: openai.OpenAI) -> None:
    message = _ask(client).choices[0].message
    reasoning, content = message.reasoning_content, message.content
    assert re.fullmatch(r"[a-z]{4,10}( [a-z]{4,10}){1,3}", reasoning), message
    assert re.fullmatch(r"[A-Z]{3,8}", content), message
    pieces, streamed = _stream(client)
    assert "".join(pieces) == reasoning and streamed == content
    assert len(pieces) > 1  # the reasoning streamed as it came
    assert not any("<" in piece for piece in pieces) and "<" not in streamed  # no tag, not even part of one
    # stream_reasoning false: the reasoning in one chunk once it ended; separate_reasoning false: no split
    assert _stream(client, stream_reasoning=False) == ([reasoning], content)
    whole = _ask(client, separate_reasoning=False).choices[0].message
    assert whole.content == f"<think>{reasoning}</think>\n{content}"
    assert getattr(whole, "reasoning_content", None) is None


def test_bad_reasoning_fields_are_400s_naming_them(server: Server) -> None:
    for name in ("separate_reasoning", "stream_reasoning"):
        reply = requests.post(
            server.url + "/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, name: "yes"},
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == name, reply.text
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "parser,text,reasoning,content",
    [
        ("deepseek-r1", "<think>a b</think>\n\nanswer", "a b", "answer"),
        (
            "deepseek-r1",
            "no start tag</think>answer",
            "no start tag",
            "answer",
        ),  # R1 opens <think> in the prompt
        ("deepseek-r1", "cut short inside", "cut short inside", ""),
        ("qwen3", "<think>\nwhy\n</think>\n\nbecause", "why", "because"),
        ("qwen3", "no thinking here", "", "no thinking here"),  # enable_thinking off
        ("qwen3-thinking", "always</think>done", "always", "done"),
    ],
)
def test_the_split_streams_a_prefix_of_the_finished_split(
    parser: str, text: str, reasoning: str, content: str
) -> None:
    split = ReasoningSplit(parser)
    assert split.split(text, finished=True)[:2] == (reasoning, content)
    sent_reasoning, sent_content = "", ""
    for end in range(len(text) + 1):  # the text as a stream sees it, a character at a time
        r, c, _ = split.split(text[:end], finished=False)
        assert r.startswith(sent_reasoning) and c.startswith(sent_content), (text[:end], r, c)
        assert "<" not in r and "</" not in c
        sent_reasoning, sent_content = r, c
    assert reasoning.startswith(sent_reasoning) and content.startswith(sent_content)


def test_the_parser_flag_is_validated() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerArgs(model_path="m", reasoning_parser="gpt-5")
    assert parse_server_args(["--model-path", "m", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
