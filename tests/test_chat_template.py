"""--chat-template (SGLang's flag) and chat on a model without a chat template: a template file
replaces the tokenizer's for the chat APIs, a name that is no file is refused at start-up, and a
chat request to a model with no template is a 400 that says what to do instead."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from server_fixture import Server
from transformers import AutoTokenizer

from srt.generate_parse import RequestError
from srt.openai_parse import chat_prompt
from srt.server_args import ServerArgs

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def test_a_chat_template_that_is_no_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--chat-template takes a Jinja template file"):
        ServerArgs(model_path="m", chat_template="chatml")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    assert ServerArgs(model_path="m", chat_template=str(template)).chat_template == str(template)


def test_chat_on_a_model_without_a_template_names_the_way_out(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = None  # as a base model's tokenizer
    tm: Any = SimpleNamespace(tokenizer=tokenizer, server_args=SimpleNamespace(tool_call_parser=None))
    with pytest.raises(RequestError, match="no chat template.*--chat-template FILE") as caught:
        chat_prompt(tm, {"messages": MESSAGES})
    assert caught.value.param == "messages"


def test_a_served_chat_renders_the_given_template(tmp_path: Path, smollm2_dir: Path) -> None:
    """The bundled model served with --chat-template: the chat prompt is the file's rendering (its
    token count in usage), and the greedy answer is /generate's on that text."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "<user> Name a colour.\n<assistant>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with Server("--chat-template", str(template)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
        native = server.generate(
            {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        ).json()
    assert reply.choices[0].message.content == native["text"]
