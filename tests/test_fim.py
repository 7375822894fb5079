"""Fill-in-the-middle: the FIM prompt ids srt/fim.py builds on Qwen2.5-Coder's tokenizer (and a
StarCoder-style one with a BOS), the bundled SmolLM2 (no FIM tokens) refusing `suffix` and
/infill by name while it keeps serving, and (slow) a Qwen2.5-Coder-1.5B server whose FIM
completions, through /infill and /v1/completions, are transformers' float32 greedy ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import real_models
import requests
import torch
from server_fixture import Server
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from srt.fim import (
    ExtraChunk,
    fim_prompt,
    find_fim_tokens,
    infill_prompt,
    require_fim_tokens,
    text_ids,
)
from srt.generate_parse import RequestError
from srt.infill_parse import parse_infill
from srt.openai_parse import parse_completion

# (prefix, suffix): gaps a code editor asks a model to fill
SNIPPETS = [
    ("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"),
    ("def is_even(n: int) -> bool:\n    return ", "\n"),
    ("def factorial(n):\n    if n == 0:\n        return 1\n    ", "\n"),
    ("import os\n\ndef list_python_files(path):\n    ", "\n    return files\n"),
    (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
        "\n\n    def pop(self):\n        return self.items.pop()\n",
    ),
    ("def reverse_string(s):\n    return ", "\n\nassert reverse_string('abc') == 'cba'\n"),
    ("numbers = [3, 1, 2]\nsorted_numbers = ", "\nprint(sorted_numbers)\n"),
    ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        ", "\n    return a\n"),
    ("function greet(name) {\n  return ", ";\n}\n\nconsole.log(greet('world'));\n"),
    ("def mean(values):\n    if not values:\n        raise ValueError('empty')\n    ", "\n"),
]
EXTRA = [
    {"filename": "geometry.py", "text": "import math\n\n\ndef circle_area(r):\n    return math.pi * r * r\n"},
    {"filename": "util.py", "text": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"},
]
QWEN_FIM = "<|fim_prefix|>{}<|fim_suffix|>{}<|fim_middle|>"
STEPS = 16


def coder_dir(name: str) -> Path:
    """The converted HF directory of a Qwen2.5-Coder GGUF, as the server converts it."""
    if not real_models.available(name):
        pytest.skip(f"{name}'s chunks are not installed: {real_models.install_command(name)}")
    from model_executor.loader.model_path import resolve_model_path

    return resolve_model_path(str(real_models.path(name)))


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(coder_dir("qwen2.5-coder-0.5b"))


def starcoder_style_tokenizer() -> Any:
    """A word-level tokenizer with StarCoder's FIM tokens that puts <s> before every text."""
    words = ["<unk>", "<s>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<|endoftext|>"]
    vocab = {w: i for i, w in enumerate(words + ["def", "f", "x", "return", ":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", unk_token="<unk>", additional_special_tokens=words[2:]
    )


def test_qwen_coder_fim_tokens_are_found_by_name(qwen_tokenizer: Any) -> None:
    fim = find_fim_tokens(qwen_tokenizer)
    assert fim is not None
    ids = qwen_tokenizer.convert_tokens_to_ids
    assert (fim.prefix, fim.suffix, fim.middle) == (
        ids("<|fim_prefix|>"),
        ids("<|fim_suffix|>"),
        ids("<|fim_middle|>"),
    )
    assert (fim.repo, fim.file_sep, fim.bos) == (ids("<|repo_name|>"), ids("<|file_sep|>"), ())
    assert set(fim.end_ids) == {
        ids(t) for t in ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
    }


@pytest.mark.parametrize(("prefix", "suffix"), SNIPPETS[:5])
def test_fim_prompt_is_the_fim_text_tokenized(qwen_tokenizer: Any, prefix: str, suffix: str) -> None:
    fim = find_fim_tokens(qwen_tokenizer)
    assert fim is not None
    ids = fim_prompt(fim, text_ids(qwen_tokenizer, prefix), text_ids(qwen_tokenizer, suffix))
    assert ids == qwen_tokenizer(QWEN_FIM.format(prefix, suffix))["input_ids"]


def test_fim_token_spellings_in_the_code_stay_text(qwen_tokenizer: Any) -> None:
    fim = find_fim_tokens(qwen_tokenizer)
    assert fim is not None
    prefix = 'MARKER = "<|fim_middle|>"\n'
    ids = fim_prompt(fim, text_ids(qwen_tokenizer, prefix), [])
    assert ids.count(fim.middle) == 1 and ids[-1] == fim.middle
    assert qwen_tokenizer.decode(ids[1:-2]) == prefix


def test_infill_prompt_lays_out_extra_files_repo_level(qwen_tokenizer: Any) -> None:
    """llama.cpp's format_infill on a tokenizer with <|repo_name|> and <|file_sep|>."""
    fim = find_fim_tokens(qwen_tokenizer)
    assert fim is not None
    prefix, suffix = SNIPPETS[0]
    extra = [ExtraChunk(c["text"], c["filename"]) for c in EXTRA]
    ids = infill_prompt(qwen_tokenizer, fim, prefix, suffix, extra, prompt="return")
    files = "".join(f"<|file_sep|>{c['filename']}\n{c['text']}" for c in EXTRA)
    text = f"<|repo_name|>myproject\n{files}<|file_sep|>filename\n" + QWEN_FIM.format(
        prefix + "return", suffix
    )
    assert qwen_tokenizer.decode(ids) == text
    # without extra files the repository and current file still head the prompt, as llama.cpp's
    assert qwen_tokenizer.decode(infill_prompt(qwen_tokenizer, fim, "a", "b", [])) == (
        "<|repo_name|>myproject\n<|file_sep|>filename\n" + QWEN_FIM.format("a", "b")
    )


def test_a_tokenizer_without_repo_tokens_gets_snippets_before_its_bos() -> None:
    tokenizer = starcoder_style_tokenizer()
    fim = find_fim_tokens(tokenizer)
    assert fim is not None and (fim.repo, fim.file_sep, fim.bos) == (None, None, (1,))
    assert set(fim.end_ids) == {5, 6}
    assert fim_prompt(fim, text_ids(tokenizer, "def f"), text_ids(tokenizer, "return x")) == [
        1,
        2,
        7,
        8,
        3,
        10,
        9,
        4,
    ]
    ids = infill_prompt(tokenizer, fim, "def f", ":", [ExtraChunk("return x")])
    separator = text_ids(tokenizer, "\n\n--- snippet ---\n\n")
    assert ids == [*separator, 10, 9, 1, 2, 7, 8, 3, 11, 4]


def test_a_model_without_fim_tokens_is_refused_by_name(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert find_fim_tokens(tokenizer) is None  # it has <repo_name> and <file_sep>, no FIM tokens
    with pytest.raises(RequestError, match="no fill-in-the-middle tokens") as info:
        require_fim_tokens(tokenizer, "suffix")
    assert info.value.param == "suffix"


def front_end(tokenizer: Any) -> Any:
    """What the parsers read of a TokenizerManager."""
    return SimpleNamespace(tokenizer=tokenizer, context_length=32768, max_total_tokens=4096)


def test_suffix_makes_each_completion_prompt_a_fim_prompt(qwen_tokenizer: Any) -> None:
    fim = find_fim_tokens(qwen_tokenizer)
    assert fim is not None
    (prefix, suffix), (other, _) = SNIPPETS[:2]
    body = {"prompt": [prefix, other], "suffix": suffix, "stop_token_ids": [13]}
    generate = parse_completion(front_end(qwen_tokenizer), body).generate_body
    fim_ids = [
        fim_prompt(fim, text_ids(qwen_tokenizer, p), text_ids(qwen_tokenizer, suffix))
        for p in (prefix, other)
    ]
    assert generate["input_ids"] == fim_ids and "text" not in generate
    assert generate["sampling_params"]["stop_token_ids"] == [13, *fim.end_ids]
    ids_prompt = parse_completion(
        front_end(qwen_tokenizer), {"prompt": [1, 2], "suffix": suffix}
    ).generate_body
    assert ids_prompt["input_ids"] == fim_prompt(fim, [1, 2], text_ids(qwen_tokenizer, suffix))
    ignoring = parse_completion(
        front_end(qwen_tokenizer), {"prompt": prefix, "suffix": suffix, "ignore_eos": True}
    )
    assert "stop_token_ids" not in ignoring.generate_body["sampling_params"]
    with pytest.raises(RequestError) as info:
        parse_completion(front_end(qwen_tokenizer), {"prompt": prefix, "suffix": suffix, "echo": True})
    assert info.value.param == "suffix"


def test_infill_body_takes_llama_cpp_defaults(qwen_tokenizer: Any) -> None:
    fim = find_fim_tokens(qwen_tokenizer)
    assert fim is not None
    prefix, suffix = SNIPPETS[0]
    call = parse_infill(
        front_end(qwen_tokenizer), {"input_prefix": prefix, "input_suffix": suffix, "seed": -1}
    )
    ids = infill_prompt(qwen_tokenizer, fim, prefix, suffix, [])
    assert call.generate_body["input_ids"] == ids == call.prompt_ids
    sampling = call.generate_body["sampling_params"]
    assert sampling == {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "stop": [],
        "ignore_eos": False,
        "max_new_tokens": 4096 - len(ids),  # n_predict -1: up to the end of what the server holds
        "stop_token_ids": list(fim.end_ids),
    }
    body = {"input_prefix": prefix, "input_suffix": suffix, "max_tokens": 5, "temperature": -1, "top_k": 0}
    body.update(seed=11, stop=["", "\n"], ignore_eos=True)
    sampling = parse_infill(front_end(qwen_tokenizer), body).generate_body["sampling_params"]
    assert (sampling["max_new_tokens"], sampling["temperature"], sampling["top_k"]) == (5, 0.0, -1)
    assert (sampling["seed"], sampling["stop"], sampling["stop_token_ids"]) == (11, ["\n"], [])


# ---- end to end on the bundled SmolLM2 ----
@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[Server]:
    with Server("--max-total-tokens", "4096") as server:
        yield server


def test_smollm2_refuses_fim_by_name_and_keeps_serving(smollm2_server: Server) -> None:
    url = smollm2_server.url
    r = requests.post(
        url + "/v1/completions", json={"prompt": "def f():", "suffix": "\n", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "suffix" and "fill-in-the-middle" in r.json()["error"]["message"]
    r = requests.post(url + "/infill", json={"input_prefix": "def f():", "input_suffix": "\n"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input_suffix" and "/infill needs fill-in-the-middle" in error["message"]
    plain: dict[str, Any] = {"prompt": "def f():", "max_tokens": 2, "temperature": 0}
    for empty in (None, ""):  # no suffix: a plain completion
        r = requests.post(url + "/v1/completions", json={**plain, "suffix": empty}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input_suffix": "x"}, "input_prefix"),
        ({"input_prefix": "x", "input_suffix": 3}, "input_suffix"),
        ({"input_prefix": "x", "input_suffix": "", "input_extra": "geometry.py"}, "input_extra"),
        ({"input_prefix": "x", "input_suffix": "", "input_extra": [{"filename": "a.py"}]}, "input_extra"),
        ({"input_prefix": "x", "input_suffix": "", "input_extra": [{"text": 1}]}, "input_extra"),
        (
            {"input_prefix": "x", "input_suffix": "", "input_extra": [{"text": "", "filename": 2}]},
            "input_extra",
        ),
        ({"input_prefix": "x", "input_suffix": "", "prompt": ["a"]}, "prompt"),
        ({"input_prefix": "x", "input_suffix": "", "n_predict": -2}, "n_predict"),
        ({"input_prefix": "x", "input_suffix": "", "stop": "\n"}, "stop"),
        ({"input_prefix": "x", "input_suffix": "", "mirostat": 2}, "mirostat"),
        ({"input_prefix": "x", "input_suffix": "", "samplers": ["top_k", "infill"]}, "samplers"),
        ({"input_prefix": "x", "input_suffix": "", "bogus": 1}, "bogus"),
    ],
)
def test_bad_infill_input_is_named_on_any_model(
    smollm2_server: Server, body: dict[str, Any], param: str
) -> None:
    r = requests.post(smollm2_server.url + "/infill", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert requests.get(smollm2_server.url + "/health", timeout=30).status_code == 200


# ---- slow: Qwen2.5-Coder-1.5B served, against transformers' float32 ----
@pytest.fixture(scope="module")
def coder_server() -> Iterator[tuple[Server, Path]]:
    model_dir = coder_dir("qwen2.5-coder-1.5b")
    with Server("--model-path", str(real_models.path("qwen2.5-coder-1.5b")), startup_timeout=600) as server:
        yield server, model_dir


def _references(model: Any, prompts: list[list[int]]) -> dict[tuple[int, ...], tuple[list[int], int]]:
    """transformers' float32 greedy continuation of each prompt (STEPS tokens, no stop) and its
    first near-tie (top two logprobs within TIE_NATS), all prompts in one left-padded batch: one
    read of the 6 GB of float32 weights a step for every prompt, not one each."""
    from test_reference_bf16 import TIE_NATS

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens, gaps = [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for _ in range(STEPS):
            logprobs = torch.log_softmax(out.logits[:, -1].float(), -1)
            top = torch.topk(logprobs, 2).values
            gaps.append(top[:, 0] - top[:, 1])
            tokens.append(logprobs.argmax(-1))
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=tokens[-1][:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    greedy, close = torch.stack(tokens, 1).tolist(), torch.stack(gaps, 1) < TIE_NATS
    ties = [int(row.nonzero()[0, 0]) if row.any() else STEPS for row in close]
    return {tuple(p): (g, t) for p, g, t in zip(prompts, greedy, ties)}


def _check_ids(reference: tuple[list[int], int], served: list[int], stops: set[int]) -> None:
    """`served` is transformers' greedy continuation up to the first near-tie of float32's own
    choice; shorter than STEPS only where it ended on a stop token."""
    expected, tie = reference
    agree = min(tie, len(served))
    print(f"served {len(served)} tokens, transformers' first near-tie at {tie}")
    assert served[:agree] == expected[:agree], (tie, served, expected)
    if len(served) < STEPS and len(served) <= tie:
        assert served[-1] in stops, served


def _check_text(reference: tuple[list[int], int], tokenizer: Any, served: str, stops: set[int]) -> None:
    """/v1/completions returns text: transformers' greedy continuation's, up to its first stop token
    (left out of the text) or its first near-tie."""
    expected, tie = reference
    end = next((i for i, token in enumerate(expected) if token in stops), STEPS)
    print(f"served {served!r}; transformers' stop at {end}, first near-tie at {tie}")
    if tie >= end:
        assert served == tokenizer.decode(expected[:end], skip_special_tokens=True), (served, expected)
    else:
        assert served.startswith(tokenizer.decode(expected[:tie], skip_special_tokens=True)), (served, tie)


def _infill(server: Server, **body: Any) -> dict[str, Any]:
    r = requests.post(
        server.url + "/infill", json={"n_predict": STEPS, "temperature": 0, **body}, timeout=300
    )
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


@pytest.mark.slow  # ~1 min a server start, ~1 min transformers' float32 1.5B on 2 cores (one batch)
@pytest.mark.timeout(2400)
def test_qwen_coder_fills_the_middle_as_transformers(coder_server: tuple[Server, Path]) -> None:
    from tiny_models import hf_float32

    server, model_dir = coder_server
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fim = find_fim_tokens(tokenizer)
    assert fim is not None
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    stops = {*fim.end_ids, *(eos if isinstance(eos, list) else [eos])}
    infill_ids = [infill_prompt(tokenizer, fim, prefix, suffix, []) for prefix, suffix in SNIPPETS]
    suffix_ids = [fim_prompt(fim, text_ids(tokenizer, p), text_ids(tokenizer, s)) for p, s in SNIPPETS]
    ring = ("import math\n\ndef ring_area(r_outer, r_inner):\n    return ", "\n")  # beside EXTRA's files
    extra_ids = infill_prompt(tokenizer, fim, *ring, [ExtraChunk(c["text"], c["filename"]) for c in EXTRA])
    references = _references(hf_float32(model_dir), [*infill_ids, *suffix_ids, extra_ids])
    for (prefix, suffix), ids, completion_ids in zip(SNIPPETS, infill_ids, suffix_ids):
        infill = _infill(server, input_prefix=prefix, input_suffix=suffix)
        assert infill["tokens_evaluated"] == len(ids) and infill["stop"] is True, infill
        assert infill["content"] == tokenizer.decode(infill["tokens"], skip_special_tokens=True)
        _check_ids(references[tuple(ids)], infill["tokens"], stops)

        body: dict[str, Any] = {"prompt": prefix, "suffix": suffix, "max_tokens": STEPS, "temperature": 0}
        r = requests.post(server.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(completion_ids), r.text
        text = r.json()["choices"][0]["text"]
        _check_text(references[tuple(completion_ids)], tokenizer, text, stops)

    infill = _infill(server, input_prefix=ring[0], input_suffix=ring[1], input_extra=EXTRA)
    assert infill["tokens_evaluated"] == len(extra_ids), infill
    _check_ids(references[tuple(extra_ids)], infill["tokens"], stops)


@pytest.mark.slow
def test_infill_streams_and_trims_its_reply_as_llama_cpp(coder_server: tuple[Server, Path]) -> None:
    server, _ = coder_server
    prefix, suffix = SNIPPETS[1]
    whole = _infill(server, input_prefix=prefix, input_suffix=suffix, n_predict=8)
    assert whole["generation_settings"]["n_predict"] == 8 and whole["stop_type"] in ("eos", "limit")
    body: dict[str, Any] = {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "n_predict": 8,
        "temperature": 0,
        "stream": True,
    }
    with requests.post(server.url + "/infill", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        events = [json.loads(line[len(b"data: ") :]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events for t in e["tokens"]] == whole["tokens"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]
    picked = _infill(
        server,
        input_prefix=prefix,
        input_suffix=suffix,
        n_predict=8,
        response_fields=["content", "generation_settings/n_predict"],
    )
    assert picked == {"content": whole["content"], "generation_settings/n_predict": 8}
