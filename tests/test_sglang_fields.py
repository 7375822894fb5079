"""SGLang's request fields that srt implements, end to end on a real server (a tiny random Llama
with SmolLM2's vocabulary, in float32, with SmolLM2's tokenizer): sampling_seed, n on /generate, logit_bias (against a transformers
loop), stop_regex, no_stop_trim, skip_special_tokens, return_prompt_token_ids, priority with
--enable-priority-scheduling; on /v1/completions a batch of prompts, echo with logprobs (the prompt's
logprobs against transformers' log-softmax, and lm-eval-harness's loglikelihood request), best_of;
on chat continue_final_message and chat_template_kwargs."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch
import transformers
from server_fixture import Server
from tiny_models import hf_float32, make_tiny_model

ATOL = 1e-4  # both sides in float32 (as tests/test_logprobs.py)
PROMPT_IDS = [(7 * i + 3) % 300 + 20 for i in range(24)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama_smollm2_vocab", tmp_path_factory.mktemp("vocab") / "llama")


@pytest.fixture(scope="module")
def server(model_dir: Path, smollm2_dir: Path) -> Iterator[Server]:
    with Server(
        "--model-path",
        str(model_dir),
        "--tokenizer-path",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
        "--enable-priority-scheduling",
        "--max-running-requests",
        "2",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return hf_float32(model_dir)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate(server: Server, **body: Any) -> Any:
    r = server.generate(body)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(max_new: int = 12, **params: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **params}


def hf_biased_greedy(model: Any, prompt: list[int], steps: int, bias: dict[int, float]) -> list[int]:
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for token, value in bias.items():
                logits[token] += value
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_sampling_seed_is_seed_and_n_fans_out(server: Server) -> None:
    sampled = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    by_seed = generate(server, input_ids=PROMPT_IDS, sampling_params={**sampled, "seed": 11})
    by_sampling_seed = generate(
        server, input_ids=PROMPT_IDS, sampling_params={**sampled, "sampling_seed": 11}
    )
    assert by_seed["output_ids"] == by_sampling_seed["output_ids"]
    fanned = generate(
        server,
        input_ids=PROMPT_IDS,
        sampling_params={**sampled, "sampling_seed": 11, "n": 3},
        return_prompt_token_ids=True,
    )
    assert isinstance(fanned, list) and [o["index"] for o in fanned] == [0, 1, 2]
    assert fanned[0]["output_ids"] == by_seed["output_ids"]  # copy 0 keeps the request's seed
    assert len({tuple(o["output_ids"]) for o in fanned}) == 3  # the others derive their own
    assert all(o["prompt_token_ids"] == PROMPT_IDS for o in fanned)
    assert "prompt_token_ids" not in by_seed
    # a batch of two prompts with n = 2: prompt i's copies are i * 2 and i * 2 + 1
    batch = generate(server, input_ids=[PROMPT_IDS, PROMPT_IDS[:10]], sampling_params={**greedy(4), "n": 2})
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [24, 24, 10, 10]


def test_logit_bias_matches_a_transformers_loop(server: Server, hf_model: Any) -> None:
    plain = generate(server, input_ids=PROMPT_IDS, sampling_params=greedy())["output_ids"]
    bias = {plain[0]: -5.0, plain[1]: -3.0, 77: 2.5}
    expected = hf_biased_greedy(hf_model, PROMPT_IDS, 12, bias)
    assert expected != plain  # the bias changes the answer
    biased = generate(
        server, input_ids=PROMPT_IDS, sampling_params=greedy(logit_bias={str(k): v for k, v in bias.items()})
    )
    assert biased["output_ids"] == expected
    forced = generate(server, input_ids=PROMPT_IDS, sampling_params=greedy(6, logit_bias={"123": 100}))
    assert forced["output_ids"] == [123] * 6


def test_stop_regex_and_no_stop_trim(server: Server, smollm2_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    full = generate(server, input_ids=PROMPT_IDS, sampling_params=greedy(24))
    ids, text = full["output_ids"], full["text"]
    for k in range(4, 24):  # two tokens whose text is printable and new: a match must span both
        before = tokenizer.decode(ids[: k - 1], skip_special_tokens=True)
        piece = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)[len(before) :]
        first = tokenizer.decode(ids[:k], skip_special_tokens=True)[len(before) :]
        if 0 < len(first) < len(piece) and piece.isascii() and piece.isprintable() and piece not in before:
            break
    else:
        pytest.skip("no two printable tokens in the greedy answer")
    pattern = re.escape(piece[:-1]) + "[" + re.escape(piece[-1]) + "]"  # matches `piece`, written as a regex
    cut = generate(server, input_ids=PROMPT_IDS, sampling_params=greedy(24, stop_regex=pattern))
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert cut["output_ids"] == ids[: k + 1]
    assert cut["text"] == text[: text.index(piece)]
    kept = generate(
        server, input_ids=PROMPT_IDS, sampling_params=greedy(24, stop_regex=pattern, no_stop_trim=True)
    )
    assert kept["text"] == text[: text.index(piece) + len(piece)]
    by_string = generate(
        server, input_ids=PROMPT_IDS, sampling_params=greedy(24, stop=piece, no_stop_trim=True)
    )
    assert by_string["text"] == kept["text"]


def test_skip_special_tokens_and_the_stop_token_trim(server: Server, smollm2_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = greedy(3, logit_bias={str(special): 100})
    assert generate(server, input_ids=PROMPT_IDS, sampling_params=forced)["text"] == ""
    shown = generate(server, input_ids=PROMPT_IDS, sampling_params={**forced, "skip_special_tokens": False})
    assert shown["text"] == "<|im_start|>" * 3
    # a stop token's text is not part of the output (as SGLang), unless no_stop_trim
    plain = generate(server, input_ids=PROMPT_IDS, sampling_params=greedy(12))
    stop_id = plain["output_ids"][3]
    trimmed = generate(server, input_ids=PROMPT_IDS, sampling_params=greedy(12, stop_token_ids=[stop_id]))
    assert trimmed["output_ids"] == plain["output_ids"][:4]
    assert trimmed["text"] == tokenizer.decode(plain["output_ids"][:3], skip_special_tokens=True)
    kept = generate(
        server, input_ids=PROMPT_IDS, sampling_params=greedy(12, stop_token_ids=[stop_id], no_stop_trim=True)
    )
    assert kept["text"] == tokenizer.decode(plain["output_ids"][:4], skip_special_tokens=True)


def test_priority_orders_the_waiting_queue(server: Server) -> None:
    """Two long requests fill --max-running-requests 2; when the shorter one ends, the four that
    wait take its slot one at a time, highest priority first (no priority: last), whatever their
    arrival order."""
    finished: list[str] = []
    lock = threading.Lock()

    def run(rid: str, max_new: int, priority: int | None) -> None:
        body: dict[str, Any] = {"input_ids": PROMPT_IDS, "rid": rid, "sampling_params": greedy(max_new)}
        if priority is not None:
            body["priority"] = priority
        assert server.generate(body, timeout=600).status_code == 200
        with lock:
            finished.append(rid)

    blockers = [
        threading.Thread(target=run, args=(rid, max_new, None))
        for rid, max_new in (("short", 1000), ("long", 7000))
    ]
    for t in blockers:
        t.start()
    deadline = time.monotonic() + 60
    while len(server.internal_state()["running"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waiting = [  # 8 tokens each: a waiting request ends 8 steps after the one before it, so the
        # client threads that record the order (an HTTP reply each) do not race the scheduler
        threading.Thread(target=run, args=(rid, 8, prio))
        for rid, prio in (("low", 1), ("none", None), ("high", 9), ("mid", 5))
    ]
    for t in waiting:
        t.start()
        time.sleep(0.05)  # arrival order: low, none, high, mid
    assert set(server.internal_state()["waiting"]) == {"low", "none", "high", "mid"}
    for t in waiting:
        t.join(600)
    requests.post(server.url + "/abort_request", json={"rid": "long"}, timeout=30)
    for t in blockers:
        t.join(600)
    assert finished[0] == "short" and finished[-1] == "long"
    assert finished[1:-1] == ["high", "mid", "low", "none"], finished


def test_completions_batch_echo_logprobs_match_transformers(client: openai.OpenAI, hf_model: Any) -> None:
    prompts = [PROMPT_IDS, PROMPT_IDS[:9]]
    reply = client.completions.create(
        model="m", prompt=prompts, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None and reply.usage.prompt_tokens == 33 and reply.usage.completion_tokens == 0
    for prompt, choice in zip(prompts, reply.choices):
        logprobs = choice.logprobs
        assert (
            logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
        )
        assert len(logprobs.token_logprobs) == len(prompt)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
        with torch.no_grad():
            rows = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        expected = rows[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), expected, atol=ATOL, rtol=0)
        assert choice.text == "".join(logprobs.tokens or [])  # the echoed prompt, token by token


def test_lm_eval_harness_loglikelihood_request(server: Server, hf_model: Any) -> None:
    """lm-eval-harness's local-completions loglikelihood payload, parsed as it parses it."""
    context, continuation = PROMPT_IDS[:16], PROMPT_IDS[16:]
    payload = {
        "model": "m",
        "prompt": [context + continuation],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = requests.post(server.url + "/v1/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ctxlen = len(context)
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    with torch.no_grad():
        rows = torch.log_softmax(hf_model(torch.tensor([context + continuation])).logits[0].float(), dim=-1)
    expected = [float(rows[p - 1, t]) for p, t in enumerate(continuation, start=ctxlen)]
    assert len(token_logprobs) == len(continuation)
    assert abs(sum(token_logprobs) - sum(expected)) < ATOL * len(expected)
    is_greedy = all(value == max(top.values()) for value, top in zip(token_logprobs, top_logprobs))
    assert is_greedy == all(int(rows[p - 1].argmax()) == t for p, t in enumerate(continuation, start=ctxlen))


def test_best_of_equal_to_n_and_streamed_echo(client: openai.OpenAI, smollm2_dir: Path) -> None:
    reply = client.completions.create(
        model="m", prompt=PROMPT_IDS, max_tokens=3, n=2, best_of=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert len(reply.choices) == 2
    kwargs: dict[str, Any] = {
        "model": "m",
        "prompt": PROMPT_IDS,
        "max_tokens": 3,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, echo=True, stream=True))
    plain = client.completions.create(**kwargs).choices[0].text
    prompt_text = transformers.AutoTokenizer.from_pretrained(smollm2_dir).decode(PROMPT_IDS)
    assert streamed == prompt_text + plain


def test_chat_continue_final_message_and_template_kwargs(
    server: Server, client: openai.OpenAI, smollm2_dir: Path
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The colour is")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = generate(server, input_ids=ids, sampling_params=greedy(5))
    reply = client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"continue_final_message": True, "ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == expected["text"]
    # chat_template_kwargs reach the template (SmolLM2's ignores unknown ones)
    kwargs = client.chat.completions.create(
        model="m",
        messages=messages[:1],
        max_tokens=2,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    expected_ids = tokenizer.apply_chat_template(
        messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert kwargs.usage is not None and kwargs.usage.prompt_tokens == len(expected_ids)


def test_stream_of_a_fanned_out_generate(server: Server) -> None:
    with requests.post(
        server.url + "/generate",
        json={"input_ids": PROMPT_IDS, "stream": True, "sampling_params": {**greedy(4), "n": 2}},
        stream=True,
        timeout=60,
    ) as r:
        chunks = [
            json.loads(line[6:])
            for line in r.iter_lines(decode_unicode=True)
            if line and line != "data: [DONE]"
        ]
    final = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(final) == [0, 1] and final[0]["output_ids"] == final[1]["output_ids"]  # greedy copies
