"""The real process tree over HTTP: outputs equal the offline engine, TP=2 equals TP=1, streaming
equals non-streaming, prefix reuse, a tiny KV budget, aborts/disconnects leave no leak, bad input
gets 400 and the server keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch
from server_fixture import Server

from srt.engine import Engine
from srt.sampling_params import SamplingParams

MAX_NEW = 10


def mixed_prompts(n: int, vocab: int = 320, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def greedy_payload(ids: list[int], max_new: int = MAX_NEW, **extra: object) -> dict[str, object]:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        **extra,
    }


def concurrent_outputs(server: Server, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    def one(ids: list[int]) -> list[int]:
        r = server.generate(greedy_payload(ids, max_new))
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]  # type: ignore[no-any-return]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def stream_output(server: Server, ids: list[int]) -> list[int]:
    with requests.post(
        server.url + "/generate", json=greedy_payload(ids, stream=True), stream=True, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    return chunks[-1]["output_ids"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_dir: Path) -> str:
    return str(smollm2_dir)


@pytest.fixture(scope="module")
def engine_reference(tiny_model_dirs: dict[str, Path]) -> list[list[int]]:
    engine = Engine(str(tiny_model_dirs["llama"]), dtype="float32", max_total_tokens=8192)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [o.output_ids for o in engine.generate(mixed_prompts(32), params)]


@pytest.fixture(scope="module")
def tp2_server(tiny_model_dirs: dict[str, Path], tokenizer_dir: str) -> Iterator[Server]:
    with Server(
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        tokenizer_dir,
        "--tp",
        "2",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
    ) as server:
        yield server


def test_tp1_server_matches_offline_engine(
    tiny_model_dirs: dict[str, Path], tokenizer_dir: str, engine_reference: list[list[int]]
) -> None:
    with Server(
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        tokenizer_dir,
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
    ) as server:
        assert concurrent_outputs(server, mixed_prompts(32)) == engine_reference


def test_tp2_server_matches_offline_engine(tp2_server: Server, engine_reference: list[list[int]]) -> None:
    assert concurrent_outputs(tp2_server, mixed_prompts(32)) == engine_reference


def test_penalties_on_the_scheduler_path_match_the_offline_engine(
    tp2_server: Server, tiny_model_dirs: dict[str, Path]
) -> None:
    """frequency / presence / repetition penalties, concurrent requests batched by the scheduler
    on two TP ranks: the offline engine's tokens (tests/test_model_parity.py holds that engine to
    transformers)."""
    prompts = mixed_prompts(8, seed=9)
    sampling = {
        "max_new_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "frequency_penalty": 0.6,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.3,
    }

    def one(ids: list[int]) -> list[int]:
        r = tp2_server.generate({"input_ids": ids, "sampling_params": sampling})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]  # type: ignore[no-any-return]

    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(one, prompts))
    with Engine(str(tiny_model_dirs["llama"]), dtype="float32", max_total_tokens=4096) as engine:
        assert served == [o.output_ids for o in engine.generate(prompts, SamplingParams(**sampling))]
    bad = tp2_server.generate({"input_ids": prompts[0], "sampling_params": {"repetition_penalty": 0}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_penalty"


def test_min_new_tokens_on_the_scheduler_path_matches_the_offline_engine(
    tp2_server: Server, tiny_model_dirs: dict[str, Path], engine_reference: list[list[int]]
) -> None:
    prompt = mixed_prompts(32)[3]
    stop = engine_reference[3][1]  # the plain greedy run's second token: it would stop at once
    sampling = {"max_new_tokens": 16, "min_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}
    served = tp2_server.generate({"input_ids": prompt, "sampling_params": sampling}).json()
    with Engine(str(tiny_model_dirs["llama"]), dtype="float32", max_total_tokens=4096) as engine:
        assert served["output_ids"] == engine.generate([prompt], SamplingParams(**sampling))[0].output_ids
    assert len(served["output_ids"]) >= 6 and stop not in served["output_ids"][:6]
    bad = tp2_server.generate(
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_new_tokens"


def test_tp2_process_tree_titles(tp2_server: Server) -> None:
    names = sorted(
        " ".join(p.cmdline()).strip() for p in tp2_server.children() if "srt::" in " ".join(p.cmdline())
    )
    assert names == ["srt::detokenizer", "srt::scheduler_TP0", "srt::scheduler_TP1"]


def test_streaming_equals_non_streaming(tp2_server: Server, engine_reference: list[list[int]]) -> None:
    prompts = mixed_prompts(32)
    for i in (0, 7, 19):
        assert stream_output(tp2_server, prompts[i]) == engine_reference[i]


def test_shared_prefix_reports_cached_tokens(tp2_server: Server) -> None:
    prefix = mixed_prompts(1, seed=11)[0] * 4
    first = tp2_server.generate(greedy_payload(prefix + [9])).json()
    second = tp2_server.generate(greedy_payload(prefix + [9])).json()
    assert second["meta_info"]["cached_tokens"] >= len(prefix)
    assert second["output_ids"] == first["output_ids"]


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        state = server.internal_state()
        if not state["running"] and not state["waiting"] and state["chunked"] is None:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.2)


def test_aborts_and_disconnects_leak_nothing(tp2_server: Server) -> None:
    long = {
        "input_ids": list(range(5, 45)),
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    # Streaming clients that hang up after two chunks.
    for _ in range(3):
        with requests.post(
            tp2_server.url + "/generate", json={**long, "stream": True}, stream=True, timeout=60
        ) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
    # Non-streaming clients that time out (disconnect) and one aborted by rid.
    with ThreadPoolExecutor(3) as pool:

        def hang_up(i: int) -> None:
            try:
                requests.post(tp2_server.url + "/generate", json={**long, "rid": f"hang{i}"}, timeout=0.5)
            except requests.Timeout:
                pass

        list(pool.map(hang_up, range(2)))
        pending = pool.submit(tp2_server.generate, {**long, "rid": "victim"})
        time.sleep(0.5)
        assert (
            requests.post(tp2_server.url + "/abort_request", json={"rid": "victim"}, timeout=10).status_code
            == 200
        )
        body = pending.result(timeout=30).json()
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    state = wait_idle(tp2_server)
    assert state["kv_integrity_error"] is None
    assert state["protected_tokens"] == 0
    assert state["free_tokens"] + state["cached_tokens"] == state["max_total_tokens"]


BAD_INPUTS: list[tuple[object, str]] = [
    ({"text": ""}, "text"),
    ({"input_ids": [1, 2], "text": "hi"}, "input_ids"),
    ({"input_ids": [1, 100000]}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": [""]}}, "stop"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10_000}}, "max_new_tokens"),
    ([1, 2, 3], "body"),
]


def test_bad_input_gets_400_and_server_keeps_serving(tp2_server: Server) -> None:
    for body, param in BAD_INPUTS:
        r = tp2_server.generate(body)  # type: ignore[arg-type]
        assert r.status_code == 400, (body, r.text)
        assert param in r.text, (body, r.text)
    r = requests.post(tp2_server.url + "/generate", data=b'{"input_ids": [1, 2', timeout=10)
    assert r.status_code == 400
    assert tp2_server.generate(greedy_payload([5, 6, 7])).status_code == 200


def test_metrics_is_404_without_enable_metrics(tp2_server: Server) -> None:
    assert requests.get(tp2_server.url + "/metrics", timeout=10).status_code == 404


def test_tiny_kv_budget_still_matches(
    tiny_model_dirs: dict[str, Path], tokenizer_dir: str, engine_reference: list[list[int]]
) -> None:
    with Server(
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        tokenizer_dir,
        "--dtype",
        "float32",
        "--max-total-tokens",
        "128",
    ) as server:
        assert concurrent_outputs(server, mixed_prompts(32)) == engine_reference
        state = wait_idle(server)
        assert state["kv_integrity_error"] is None


def test_smollm2_server_matches_offline_engine(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        f"Question {i}: what is {i} plus {i * 3}? " + "Think step by step. " * (i % 5) for i in range(32)
    ]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    engine = Engine(None, dtype="float32", max_total_tokens=16384)
    expected = [
        o.output_ids
        for o in engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    ]
    del engine
    with Server("--dtype", "float32", "--max-total-tokens", "16384") as server:
        assert concurrent_outputs(server, prompts, max_new=8) == expected
        text = server.generate(
            {"text": texts[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
        ).json()
        assert text["output_ids"] == expected[0]
        assert text["text"] == tokenizer.decode(expected[0], skip_special_tokens=True)
        # A stop string from the middle of that answer (it may span tokens) ends it, excluded.
        full = text["text"]
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        assert stop.strip(), full
        stopped = server.generate(
            {
                "text": texts[0],
                "sampling_params": {
                    "max_new_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stop": [stop],
                },
            }
        ).json()
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stopped["text"] == full[: full.index(stop)]
    assert not psutil.pid_exists(server.proc.pid) or psutil.Process(server.proc.pid).status() == "zombie"


def test_a_text_the_model_cannot_embed_is_a_400(tp2_server: Server) -> None:
    """The tiny model's 320-token vocabulary is smaller than its tokenizer's: ids past it would
    crash a rank's embedding, so the front end refuses them and the server keeps serving."""
    r = tp2_server.generate({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    assert "vocabulary" in r.json()["error"]["message"]
    assert tp2_server.generate(greedy_payload([5, 6, 7])).status_code == 200
