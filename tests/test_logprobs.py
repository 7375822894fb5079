"""Logprobs on /generate against one real TP=2 server on the tiny Llama (float32, prompts chunked
by --chunked-prefill-size 16): they equal transformers' log-softmax of the same model's logits,
for the prompt (logprob_start_len) and the output, greedy or sampled (temperature does not change
them), streamed chunk by chunk, with a cached prefix, and without generating at all. Requests that
do not ask get no logprobs and the same tokens; bad options get a 400 naming them. In-process, the
scheduler gives the same logprobs under retraction, chunking and paging as with room to spare."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import transformers
from scheduler_harness import Harness
from server_fixture import Server

from srt.io_struct import BatchTokenIDOut, TokenizedGenerateReq
from srt.sampling_params import SamplingParams

# Both sides compute in float32; the server's kernels (paged SDPA, TP all-reduce, its own
# matmuls) differ from transformers' in the last bits (under 1e-5 here), well inside this.
ATOL = 1e-4
PROMPT = [(7 * i + 3) % 300 + 10 for i in range(40)]  # 40 tokens: three prefill chunks of <= 16


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], smollm2_dir: Path) -> Iterator[Server]:
    with Server(
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        str(smollm2_dir),
        "--tp",
        "2",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
        "--chunked-prefill-size",
        "16",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def hf_model(tiny_model_dirs: dict[str, Path]) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dirs["llama"], torch_dtype=torch.float32
    ).eval()


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is log p(next token | ids[:p + 1])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def generate(server: Server, **body: Any) -> dict[str, Any]:
    r = server.generate(body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def greedy(max_new: int = 8, **extra: Any) -> dict[str, Any]:
    return {"sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, **extra}


def check_entries(entries: list[list[Any]], tokens: list[int], rows: torch.Tensor) -> None:
    """entries[i] == [log p(tokens[i]) from rows[i], tokens[i], None]."""
    assert [e[1] for e in entries] == tokens and all(e[2] is None for e in entries)
    expected = rows.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor([e[0] for e in entries]), expected, atol=ATOL, rtol=0)


def check_top(tops: list[list[list[Any]]], rows: torch.Tensor, k: int) -> None:
    values, _ = rows.topk(k, dim=-1)
    assert all(len(top) == k for top in tops)
    got = torch.tensor([[entry[0] for entry in top] for top in tops])
    torch.testing.assert_close(got, values, atol=ATOL, rtol=0)
    for top, row in zip(tops, rows):  # each listed id has the listed logprob (ties may swap ids)
        torch.testing.assert_close(
            torch.tensor([e[0] for e in top]), row[[e[1] for e in top]], atol=ATOL, rtol=0
        )


def test_greedy_logprobs_match_transformers(server: Server, hf_model: Any) -> None:
    out = generate(
        server, input_ids=PROMPT, return_logprob=True, top_logprobs_num=5, logprob_start_len=0, **greedy()
    )
    meta, output_ids = out["meta_info"], out["output_ids"]
    reference = hf_logprobs(hf_model, PROMPT + output_ids)
    n = len(PROMPT)
    assert (
        output_ids == reference[n - 1 : n - 1 + len(output_ids)].argmax(-1).tolist()
    )  # the same greedy path
    check_entries(meta["output_token_logprobs"], output_ids, reference[n - 1 : n - 1 + len(output_ids)])
    check_top(meta["output_top_logprobs"], reference[n - 1 : n - 1 + len(output_ids)], 5)
    # Greedy: the chosen token is the most likely one.
    assert [top[0][1] for top in meta["output_top_logprobs"]] == output_ids
    prompt_entries = meta["input_token_logprobs"]
    assert len(prompt_entries) == n and prompt_entries[0] == [None, PROMPT[0], None]
    assert meta["input_top_logprobs"][0] is None
    check_entries(prompt_entries[1:], PROMPT[1:], reference[: n - 1])
    check_top(meta["input_top_logprobs"][1:], reference[: n - 1], 5)


def test_token_ids_logprob_match_transformers(server: Server, hf_model: Any) -> None:
    """SGLang's token_ids_logprob: the logprobs of the ids asked for, in their order, at every output
    and (with logprob_start_len) prompt position; a batch may ask for other ids per prompt."""
    asked = [250, 3, 77]
    out = generate(
        server,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=0,
        token_ids_logprob=asked,
        **greedy(6),
    )
    meta, output_ids = out["meta_info"], out["output_ids"]
    reference = hf_logprobs(hf_model, PROMPT + output_ids)
    n = len(PROMPT)
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == len(output_ids) and "output_top_logprobs" not in meta
    for row, ref in zip(rows, reference[n - 1 :]):
        assert [entry[1] for entry in row] == asked and all(entry[2] is None for entry in row)
        torch.testing.assert_close(torch.tensor([e[0] for e in row]), ref[asked], atol=ATOL, rtol=0)
    prompt_rows = meta["input_token_ids_logprobs"]
    assert len(prompt_rows) == n and prompt_rows[0] is None
    for row, ref in zip(prompt_rows[1:], reference[: n - 1]):
        torch.testing.assert_close(torch.tensor([e[0] for e in row]), ref[asked], atol=ATOL, rtol=0)
    both = generate(
        server,
        input_ids=[PROMPT[:9], PROMPT[:14]],
        return_logprob=True,
        token_ids_logprob=[[5], None],
        **greedy(2),
    )
    assert [e[1] for e in both[0]["meta_info"]["output_token_ids_logprobs"][0]] == [5]
    assert "output_token_ids_logprobs" not in both[1]["meta_info"]


def test_score_is_the_labels_next_token_probability(server: Server, hf_model: Any) -> None:
    """SGLang's /v1/score on token ids: exp(logprob) of each label after query + item (item_first:
    item + query), or the softmax over the labels; float32, so within ATOL of transformers."""
    query, items, labels = PROMPT[:6], [PROMPT[10:13], PROMPT[20:22]], [11, 42, 300]
    r = requests.post(
        f"{server.url}/v1/score", json={"query": query, "items": items, "label_token_ids": labels}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and body["usage"]["prompt_tokens"] == 6 + 3 + 6 + 2
    for item, row in zip(items, body["scores"]):
        ref = hf_logprobs(hf_model, query + item)[-1, labels].exp()
        torch.testing.assert_close(torch.tensor(row), ref, atol=ATOL, rtol=0)
    r = requests.post(
        f"{server.url}/v1/score",
        json={
            "query": query,
            "items": items,
            "label_token_ids": [[11, 42], [300, 7]],
            "apply_softmax": True,
            "temperature": 0.5,
            "item_first": True,
            "return_token_logprobs": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    for item, pair, row, logprobs in zip(items, [[11, 42], [300, 7]], body["scores"], body["token_logprobs"]):
        ref = hf_logprobs(hf_model, item + query)[-1, pair]
        torch.testing.assert_close(torch.tensor(logprobs), ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(row), torch.softmax(ref / 0.5, dim=0), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": [1], "items": [[2]]}, "label_token_ids"),
        ({"query": [1], "items": [[2]], "label_token_ids": [5, 5]}, "label_token_ids"),
        ({"query": [1], "items": [[2], [3]], "label_token_ids": [[5]]}, "label_token_ids"),
        ({"query": [1], "label_token_ids": [5]}, "items"),
        ({"query": [1], "items": [[2]], "label_token_ids": [5], "temperature": 2.0}, "temperature"),
        (
            {"query": [1], "items": [[2]], "label_token_ids": [5], "score_extraction_token": "x"},
            "score_extraction_token",
        ),
        ({"query": [1], "items": [[2]], "label_token_ids": [5], "colour": 1}, "colour"),
    ],
)
def test_bad_score_fields_get_400_naming_them(server: Server, body: dict[str, Any], param: str) -> None:
    r = requests.post(f"{server.url}/v1/score", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_logprob_start_len_recomputes_a_cached_prefix(server: Server, hf_model: Any) -> None:
    prompt = PROMPT[::-1]
    plain = generate(server, input_ids=prompt, **greedy())  # puts the whole prompt in the prefix cache
    start = 25
    out = generate(server, input_ids=prompt, return_logprob=True, logprob_start_len=start, **greedy())
    meta = out["meta_info"]
    assert out["output_ids"] == plain["output_ids"]
    assert 0 < meta["cached_tokens"] <= start - 1  # reused up to the first position it must score
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    reference = hf_logprobs(hf_model, prompt + out["output_ids"])
    check_entries(meta["input_token_logprobs"], prompt[start:], reference[start - 1 : len(prompt) - 1])


def test_sampled_logprobs_ignore_temperature(server: Server, hf_model: Any) -> None:
    body = {
        "input_ids": PROMPT[:12],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 1.7, "seed": 11, "ignore_eos": True},
    }
    out = generate(server, **body)
    n = 12
    reference = hf_logprobs(hf_model, PROMPT[:12] + out["output_ids"])
    check_entries(out["meta_info"]["output_token_logprobs"], out["output_ids"], reference[n - 1 : n - 1 + 10])


def test_streamed_logprobs_arrive_with_their_tokens(server: Server) -> None:
    body = {
        "input_ids": PROMPT[:20],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "stream": True,
        **greedy(max_new=12),
    }
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert len(chunks) >= 12  # one update per token (--stream-interval 1)
    for chunk in chunks:  # cumulative, like text and output_ids: one entry per token so far
        meta = chunk["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == chunk["output_ids"]
        assert len(meta["output_top_logprobs"]) == len(chunk["output_ids"])
    full = generate(server, **{**body, "stream": False})
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"]
    assert chunks[-1]["meta_info"]["output_top_logprobs"] == full["meta_info"]["output_top_logprobs"]


def test_prompt_scored_without_generating(server: Server, hf_model: Any) -> None:
    out = generate(
        server, input_ids=PROMPT[:30], return_logprob=True, logprob_start_len=0, **greedy(max_new=0)
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 0
    check_entries(meta["input_token_logprobs"][1:], PROMPT[1:30], hf_logprobs(hf_model, PROMPT[:30])[:29])


def test_requests_without_logprobs_are_unchanged(server: Server) -> None:
    prompts = [PROMPT[:9], PROMPT[5:27]]
    plain = [generate(server, input_ids=p, **greedy())["output_ids"] for p in prompts]
    batch = server.generate(
        {"input_ids": prompts, "return_logprob": [True, False], "return_text_in_logprobs": True, **greedy()}
    ).json()
    assert [item["output_ids"] for item in batch] == plain
    entries = batch[0]["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == plain[0] and all(isinstance(e[2], str) for e in entries)
    assert not any("logprobs" in key for key in batch[1]["meta_info"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"return_logprob": "yes"}, "return_logprob"),
        ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"return_logprob": True, "top_logprobs_num": 1.5}, "top_logprobs_num"),
        ({"return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),  # the prompt has 5 tokens
        ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"return_logprob": [True, False]}, "return_logprob"),  # a list for a single prompt
        ({"return_text_in_logprobs": 1}, "return_text_in_logprobs"),
        ({"return_logprob": True, "token_ids_logprob": [1, -1]}, "token_ids_logprob"),
        ({"return_logprob": True, "token_ids_logprob": [320]}, "token_ids_logprob"),  # the vocabulary is 320
        ({"return_logprob": True, "token_ids_logprob": []}, "token_ids_logprob"),
        ({"return_logprob": True, "token_ids_logprob": 5}, "token_ids_logprob"),
    ],
)
def test_bad_logprob_options_get_400_naming_them(server: Server, extra: dict[str, Any], param: str) -> None:
    r = server.generate({"input_ids": PROMPT[:5], **greedy(max_new=2), **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def scheduler_logprobs(model_dir: Path, prompts: list[list[int]], **server_args: Any) -> dict[str, Any]:
    """rid -> (output ids, output logprobs, prompt logprobs) from one in-process scheduler."""
    h = Harness(model_dir, **server_args)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        h.send(
            TokenizedGenerateReq(
                f"r{i}", prompt, params, seed=0, return_logprob=True, top_logprobs_num=2, logprob_start_len=0
            )
        )
    result: dict[str, Any] = {f"r{i}": ([], [], None) for i in range(len(prompts))}
    retracted = False
    for _ in range(5000):
        h.scheduler.step()
        retracted |= any(r.retractions for r in h.scheduler.waiting)
        for out in h.outputs:
            assert isinstance(out, BatchTokenIDOut)
            for i, rid in enumerate(out.rids):
                ids, values, prompt_lp = result[rid]
                assert out.output_logprobs[i].token_ids == out.new_token_ids[i]
                ids += out.new_token_ids[i]
                values += out.output_logprobs[i].values
                result[rid] = (ids, values, out.input_logprobs[i] or prompt_lp)
        h.outputs.clear()
        if not (h.scheduler.waiting or h.scheduler.running or h.scheduler.chunked_req):
            break
    assert h.integrity_error() is None
    return {"retracted": retracted, **result}


def test_scheduler_logprobs_survive_retraction_chunking_and_paging(tiny_model_dirs: dict[str, Path]) -> None:
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 300, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (10,), generator=g)
    ]
    roomy = scheduler_logprobs(tiny_model_dirs["llama"], prompts, max_total_tokens=8192)
    tight = scheduler_logprobs(
        tiny_model_dirs["llama"], prompts, max_total_tokens=120, page_size=4, chunked_prefill_size=8
    )
    assert tight["retracted"] and not roomy["retracted"]
    for i, prompt in enumerate(prompts):
        (ids, values, prompt_lp), (t_ids, t_values, t_prompt_lp) = roomy[f"r{i}"], tight[f"r{i}"]
        assert t_ids == ids and len(values) == len(ids) == 16
        torch.testing.assert_close(torch.tensor(t_values), torch.tensor(values), atol=ATOL, rtol=0)
        assert prompt_lp is not None and t_prompt_lp is not None
        assert prompt_lp.token_ids == t_prompt_lp.token_ids == prompt and prompt_lp.values[0] is None
        torch.testing.assert_close(
            torch.tensor(t_prompt_lp.values[1:]), torch.tensor(prompt_lp.values[1:]), atol=ATOL, rtol=0
        )
