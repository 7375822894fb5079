"""LoRA adapters loaded and unloaded while the server runs (issue 61, slice 2), on a real server:
SGLang's and vLLM's endpoints, adapters loaded at runtime held to PeftModel, bad loads refused by
cause with nothing changed, unloads that wait for their requests, TP=2, many cycles. The registry on
its own: tests/test_lora_registry.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch
from safetensors.torch import save_file
from scheduler_harness import Harness
from server_fixture import Server
from test_lora import MAX_NEW, generate_batch, make_adapter, prompts, reference_tokens, tiny_adapters
from test_restart import streams_through_a_kill

from srt.generate_parse import RequestError
from srt.io_struct import ControlReply, TokenizedGenerateReq, UnloadLoraAdapterReq
from srt.lora_residency import LoraResidency
from srt.sampling_params import SamplingParams
from srt.tokenizer_manager import TokenizerManager

# ---- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """test_lora's tiny Qwen2 and its adapters qv8, all16, rows4."""
    return tiny_adapters(tmp_path_factory.mktemp("lora"))


def test_the_ranks_finish_the_requests_before_an_unload_and_refuse_the_ones_after(
    tiny: dict[str, Path],
) -> None:
    """One rank's scheduler, messages in the order rank 0 broadcasts them: a request under qv8, its
    unload, another request under qv8. The first runs to its end; the second is a 400 naming the
    adapter; the unload's reply comes in a step after the first finished, and qv8 is gone."""
    h = Harness(tiny["base"], lora_paths=(f"qv8={tiny['qv8']}",))
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    h.send(TokenizedGenerateReq("before", [5, 6, 7], params, 0, lora_path="qv8"))
    h.send(UnloadLoraAdapterReq("u", "qv8"))
    h.send(TokenizedGenerateReq("after", [5, 6, 7], params, 0, lora_path="qv8"))
    replies: list[ControlReply] = []
    for _ in range(100):
        h.scheduler.step()
        if any(isinstance(out, ControlReply) for out in h.outputs):
            assert "before" in h.finished, "the unload answered while its request was running"
        replies += [out for out in h.outputs if isinstance(out, ControlReply)]
        h._collect()
        if replies:
            break
    assert len(h.tokens["before"]) == 20 and h.finished["before"].type == "length"
    refused = h.finished["after"]
    assert refused.status_code == 400 and "'qv8'" in refused.message
    assert [(r.request_id, r.success) for r in replies] == [("u", True)]
    assert h.scheduler.lora.snapshot() == [] and h.scheduler.lora.id_of("qv8") is None


def lacking_module_adapter(tiny: dict[str, Path], path: Path) -> Path:
    """An adapter whose config passes the front end's checks but whose tensors target a module the
    base model lacks: refused where each rank attaches it."""
    path.mkdir()
    (path / "adapter_config.json").write_text((tiny["qv8"] / "adapter_config.json").read_text())
    module = "base_model.model.model.layers.0.self_attn.c_attn"
    save_file(
        {f"{module}.lora_A.weight": torch.randn(8, 64), f"{module}.lora_B.weight": torch.randn(64, 8)},
        str(path / "adapter_model.safetensors"),
    )
    return path


def runtime_flags(tiny: dict[str, Path], tokenizer: Path) -> list[str]:
    """The tiny base with qv8 from the start, the other adapters for runtime loads."""
    flags = ["--model-path", str(tiny["base"]), "--tokenizer-path", str(tokenizer), "--dtype", "float32"]
    return [
        *flags,
        "--max-total-tokens",
        "4096",
        "--lora-paths",
        f"qv8={tiny['qv8']}",
        "--max-lora-rank",
        "16",
    ]


def post(server: Server, route: str, body: Any) -> requests.Response:
    return requests.post(server.url + route, json=body, timeout=120)


def model_ids(server: Server) -> list[str]:
    return [c["id"] for c in requests.get(server.url + "/v1/models", timeout=30).json()["data"][1:]]


@pytest.fixture(scope="module")
def runtime_server(tiny: dict[str, Path], smollm2_dir: Path) -> Iterator[Server]:
    with Server(*runtime_flags(tiny, smollm2_dir)) as server:
        yield server


def test_an_adapter_loaded_at_runtime_gives_peft_tokens(
    tiny: dict[str, Path], runtime_server: Server
) -> None:
    """SGLang's /load_lora_adapter and vLLM's /v1/load_lora_adapter, each answering in its shape;
    the adapters then run beside the start-up one and the base, each row PeftModel's tokens, and
    /v1/models lists them; the OpenAI client selects one by name."""
    reply = post(
        runtime_server, "/load_lora_adapter", {"lora_name": "all16", "lora_path": str(tiny["all16"])}
    )
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"qv8": str(tiny["qv8"]), "all16": str(tiny["all16"])},
    }
    reply = post(
        runtime_server, "/v1/load_lora_adapter", {"lora_name": "rows4", "lora_path": str(tiny["rows4"])}
    )
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'rows4' added successfully."
    assert model_ids(runtime_server) == ["qv8", "all16", "rows4"]
    batch = prompts(320, (6, 11, 3, 20), seed=11)
    names: list[str | None] = [None, "qv8", "all16", "rows4"]
    outs = generate_batch(runtime_server, batch, names)
    assert [o["output_ids"] for o in outs] == reference_tokens(tiny, batch, names)
    client = openai.OpenAI(base_url=runtime_server.url + "/v1", api_key="none")
    text = client.completions.create(model="rows4", prompt=batch[3], max_tokens=MAX_NEW, temperature=0.0)
    assert text.choices[0].text == generate_batch(runtime_server, [batch[3]], ["rows4"])[0]["text"]


def test_a_bad_load_is_a_400_naming_the_cause_and_changes_nothing(
    tiny: dict[str, Path], runtime_server: Server, tmp_path: Path
) -> None:
    """A missing folder, a rank above --max-lora-rank (the front end's checks), a module the model
    lacks (refused where the ranks attach it), a weights file cut short: 400 naming the cause; the server keeps serving, the
    name is not listed, the loaded adapters give the tokens they gave."""
    prompt = prompts(320, (9,), seed=12)
    before = generate_batch(runtime_server, prompt, ["qv8"])[0]["output_ids"]
    listed = model_ids(runtime_server)
    big = make_adapter(tiny["base"], tmp_path / "r32", ["q_proj"], 32, seed=9)
    corrupt = make_adapter(tiny["base"], tmp_path / "corrupt", ["q_proj"], 8, seed=10)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short: the header promises more
    cases = [
        (tmp_path / "missing", "no adapter_config.json"),
        (big, "exceeds --max-lora-rank 16"),
        (lacking_module_adapter(tiny, tmp_path / "lacking"), "no linear layer srt adapts"),
        (corrupt, "adapter_model.safetensors could not be read"),
    ]
    for folder, cause in cases:
        reply = post(runtime_server, "/load_lora_adapter", {"lora_name": "bad", "lora_path": str(folder)})
        assert reply.status_code == 400 and cause in reply.json()["error_message"], reply.text
        assert reply.json()["success"] is False
        reply = post(runtime_server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(folder)})
        assert reply.status_code == 400 and cause in reply.json()["error"]["message"], reply.text
    assert model_ids(runtime_server) == listed
    refused = runtime_server.generate({"input_ids": prompt[0], "lora_path": "bad"})
    assert refused.status_code == 400 and "bad" in refused.text
    assert generate_batch(runtime_server, prompt, ["qv8"])[0]["output_ids"] == before
    for route in ("/unload_lora_adapter", "/v1/unload_lora_adapter"):
        assert post(runtime_server, route, {"lora_name": "bad"}).status_code in (400, 404)


def test_a_load_with_a_bad_field_is_a_400_naming_it(runtime_server: Server) -> None:
    reply = post(runtime_server, "/load_lora_adapter", {"lora_name": 3, "lora_path": "/x"})
    assert reply.status_code == 400 and "lora_name" in reply.json()["error_message"]
    reply = post(runtime_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": ["/x"]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path"


def test_without_enable_lora_a_load_or_unload_is_a_400_naming_the_flag() -> None:
    tm = TokenizerManager.__new__(TokenizerManager)  # the checks before anything is sent
    tm.lora_names = None
    for call in (tm.load_lora_adapter("a", "/a"), tm.unload_lora_adapter("a")):
        with pytest.raises(RequestError, match="--enable-lora"):
            asyncio.run(call)


def test_unloading_an_adapter_in_use_waits_for_its_streaming_request(
    tiny: dict[str, Path], runtime_server: Server
) -> None:
    """Unload while a streamed request runs under the adapter: new requests naming it are a 400 at
    once, the stream completes with the tokens it gives alone, the unload answers after it, and the
    name is a 400 from then on (and listed no more)."""
    path = str(tiny["all16"]) if "all16" not in model_ids(runtime_server) else None
    if path is not None:
        assert post(runtime_server, "/load_lora_adapter", {"lora_name": "all16", "lora_path": path}).ok
    prompt = prompts(320, (7,), seed=13)
    long = 240
    expected = generate_batch(runtime_server, prompt, ["all16"], max_new=long)[0]["output_ids"]
    body: dict[str, Any] = {
        "input_ids": prompt[0],
        "lora_path": "all16",
        "stream": True,
        "sampling_params": {"max_new_tokens": long, "temperature": 0.0, "ignore_eos": True},
    }
    unload: dict[str, Any] = {}

    def unload_it() -> None:
        unload["reply"] = post(runtime_server, "/unload_lora_adapter", {"lora_name": "all16"})
        unload["at"] = time.monotonic()

    thread = threading.Thread(target=unload_it)
    last: dict[str, Any] = {}
    with requests.post(runtime_server.url + "/generate", json=body, stream=True, timeout=120) as stream:
        for line in stream.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            last = json.loads(line[len(b"data: ") :])
            if not thread.is_alive() and "reply" not in unload:
                thread.start()
                time.sleep(0.2)  # the unload reaches the ranks
                refused = runtime_server.generate({"input_ids": prompt[0], "lora_path": "all16"})
                assert refused.status_code == 400 and "all16" in refused.text
                assert "reply" not in unload, "the unload answered while its request was running"
        ended = time.monotonic()
    thread.join(60)
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"] == expected
    assert unload["reply"].status_code == 200 and "all16" not in unload["reply"].json()["loaded_adapters"]
    assert unload["at"] >= ended - 1.0
    assert "all16" not in model_ids(runtime_server)
    assert runtime_server.generate({"input_ids": prompt[0], "lora_path": "all16"}).status_code == 400
    reply = post(runtime_server, "/v1/unload_lora_adapter", {"lora_name": "all16"})
    assert reply.status_code == 404 and "cannot be found" in reply.text


def test_a_name_loaded_again_runs_its_new_adapter_with_none_of_the_old_ones_prefixes(
    tiny: dict[str, Path], runtime_server: Server
) -> None:
    """Unload "swap" (all16) and load "swap" from rows4's folder: the same prompt gives rows4's
    tokens and reuses nothing cached under all16 (the new adapter has a new id, its own namespace)."""
    prompt = prompts(320, (40,), seed=16)
    for folder, name in ((tiny["all16"], "all16"), (tiny["rows4"], "rows4")):
        assert post(runtime_server, "/load_lora_adapter", {"lora_name": "swap", "lora_path": str(folder)}).ok
        (out,) = generate_batch(runtime_server, prompt, ["swap"])
        assert out["output_ids"] == reference_tokens(tiny, prompt, [name])[0]
        assert out["meta_info"]["cached_tokens"] == 0
        assert post(runtime_server, "/unload_lora_adapter", {"lora_name": "swap"}).ok


@pytest.mark.slow
@pytest.mark.parametrize("split", ["--tp-size", "--pp-size"])
def test_two_ranks_load_at_runtime_and_give_peft_tokens(
    tiny: dict[str, Path], smollm2_dir: Path, tmp_path: Path, split: str
) -> None:
    """Two gloo ranks (TP=2, or two pipeline stages): a runtime load gives PeftModel's tokens; one
    refused where the ranks attach it is a 400 and changes nothing on either."""
    batch = prompts(320, (6, 11, 3), seed=14)
    names: list[str | None] = [None, "qv8", "all16"]
    with Server(*runtime_flags(tiny, smollm2_dir), split, "2") as server:
        assert post(server, "/load_lora_adapter", {"lora_name": "all16", "lora_path": str(tiny["all16"])}).ok
        bad = lacking_module_adapter(tiny, tmp_path / "lacking")
        reply = post(server, "/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
        assert reply.status_code == 400 and "no linear layer" in reply.json()["error_message"]
        outs = generate_batch(server, batch, names)
        assert model_ids(server) == ["qv8", "all16"]
    assert [o["output_ids"] for o in outs] == reference_tokens(tiny, batch, names)


def stream_tokens(
    server: Server, prompt: list[int], adapter: str | None, max_new: int = MAX_NEW
) -> list[int]:
    """A streamed greedy request's output ids, from its last event."""
    body: dict[str, Any] = {
        "input_ids": prompt,
        "lora_path": adapter,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
    }
    last: dict[str, Any] = {}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith(b"data: {"):
                last = json.loads(line[len(b"data: ") :])
    assert last["meta_info"]["finish_reason"]["type"] == "length", last
    return list(last["output_ids"])


@pytest.mark.slow
def test_streams_under_a_runtime_adapter_survive_a_sigkilled_rank(
    tiny: dict[str, Path], smollm2_dir: Path
) -> None:
    """The tiny base in bf16 (deterministic inference on by itself with --restart-on-failure, each
    adapter row's delta on its own): an adapter loaded at runtime, four streams (two under it), a
    rank SIGKILLed mid-stream; after the restart the adapter is loaded again before the replays, and
    every stream's ids and logprobs equal a fault-free run's on the same server."""
    batch = prompts(320, (6, 11, 3, 20), seed=17)
    names = ["all16", None, "all16", None]
    bodies = [
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "lora_path": name,
        }
        for prompt, name in zip(batch, names)
    ]
    flags = ["--model-path", str(tiny["base"]), "--tokenizer-path", str(smollm2_dir), "--enable-lora"]
    with Server(*flags, "--max-total-tokens", "4096", "--restart-on-failure", "1") as server:
        assert post(server, "/load_lora_adapter", {"lora_name": "all16", "lora_path": str(tiny["all16"])}).ok
        with ThreadPoolExecutor(len(bodies)) as pool:
            expected = [r.json() for r in pool.map(lambda b: server.generate(b, timeout=300), bodies)]
        base = server.generate({**bodies[0], "lora_path": None}).json()
        assert expected[0]["output_ids"] != base["output_ids"]  # the adapter changes its streams
        assert post(server, "/flush_cache", {}).status_code == 200
        results = streams_through_a_kill(server, bodies, "srt::scheduler_TP0", after=20, timeout=300)
        out = server.output()
        assert "killed by signal SIGKILL; restarting the engine" in out and "engine restarted in" in out
        assert "deterministic inference: every token on the decode kernel's arithmetic" in out
        for i, ((ids, _, logprobs, _), want) in enumerate(zip(results, expected)):
            assert ids == want["output_ids"], f"stream {i} ({names[i]}) parts from the fault-free run"
            assert logprobs == want["meta_info"]["output_token_logprobs"], f"stream {i}'s logprobs"
        assert model_ids(server) == ["all16"]


def scheduler_rss(server: Server) -> int:
    processes = requests.get(server.url + "/server_info", timeout=30).json()["memory"]["processes"]
    return sum(int(p["rss_bytes"]) for p in processes if "scheduler" in str(p["name"]))


@pytest.mark.slow
def test_load_and_unload_50_times_while_requests_stream(tiny: dict[str, Path], smollm2_dir: Path) -> None:
    """50 load/unload cycles while another adapter's and the base's requests stream: no error, every
    stream PeftModel's tokens, and the ranks' resident memory at the end within 5% of after the
    first cycles."""
    prompt = prompts(320, (8,), seed=15)
    expected = reference_tokens(tiny, prompt * 2, ["qv8", None])
    errors: list[str] = []
    stop = threading.Event()

    def stream_requests(server: Server) -> None:
        while not stop.is_set():
            tokens = [stream_tokens(server, prompt[0], name) for name in ("qv8", None)]
            if tokens != expected:
                errors.append(f"a streamed request's tokens changed: {tokens} != {expected}")

    with Server(*runtime_flags(tiny, smollm2_dir)) as server:
        thread = threading.Thread(target=stream_requests, args=(server,))
        thread.start()
        try:
            rss: list[int] = []
            for cycle in range(50):
                for route, body in (
                    ("/load_lora_adapter", {"lora_name": "all16", "lora_path": str(tiny["all16"])}),
                    ("/unload_lora_adapter", {"lora_name": "all16"}),
                ):
                    reply = post(server, route, body)
                    if reply.status_code != 200:
                        errors.append(f"cycle {cycle} {route}: {reply.text}")
                rss.append(scheduler_rss(server))
        finally:
            stop.set()
            thread.join(60)
    assert not errors, errors[:3]
    assert rss[4] > 100 * 2**20  # the scheduler's process, found
    assert rss[-1] <= rss[4] * 1.05, [r // 2**20 for r in rss]


def test_the_residency_bound_picks_the_least_recently_used_or_first_loaded_unpinned_adapter() -> None:
    lru = LoraResidency(2, "lru", ["a", "b"])
    lru.used(["a", "unknown"])
    lru.loaded("c", pinned=False)
    assert lru.over_bound() == ["b"]  # a was asked for after b
    fifo = LoraResidency(2, "fifo", ["a", "b"])
    fifo.used(["a"])
    fifo.loaded("c", pinned=False)
    assert fifo.over_bound() == ["a"]
    pinned = LoraResidency(1, "lru", [])
    pinned.loaded("p", pinned=True)
    pinned.loaded("q", pinned=False)
    pinned.loaded("r", pinned=False)
    assert pinned.over_bound() == ["q", "r"]  # p pinned: both others to fit one
    pinned.unloaded("q")
    assert pinned.over_bound() == ["r"] and LoraResidency(None, "lru", ["a", "b"]).over_bound() == []
    with pytest.raises(ValueError, match="--lora-eviction-policy"):
        LoraResidency(2, "random", [])


@pytest.mark.slow
def test_a_load_past_max_loaded_loras_unloads_the_least_recently_used_adapter(
    tiny: dict[str, Path], smollm2_dir: Path
) -> None:
    """SGLang's --max-loaded-loras (default bf16 path): with two allowed, loading a third unloads the adapter whose last
    request is the oldest (never a pinned one), on every rank; its name is then a 400, the others
    still serve."""
    flags = runtime_flags(tiny, smollm2_dir)
    del flags[flags.index("--dtype") : flags.index("--dtype") + 2]  # the default path: bf16, the kernels
    flags += ["--max-loaded-loras", "2", "--max-loras-per-batch", "2"]
    with Server(*flags) as server:
        body = {"lora_name": "all16", "lora_path": str(tiny["all16"]), "pinned": True}
        assert post(server, "/load_lora_adapter", body).json()["success"]
        one = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        assert post(server, "/generate", {**one, "lora_path": "qv8"}).status_code == 200
        reply = post(server, "/load_lora_adapter", {"lora_name": "rows4", "lora_path": str(tiny["rows4"])})
        # all16 is pinned, so qv8 leaves though it was asked for after all16 was loaded
        assert reply.json()["success"] and set(reply.json()["loaded_adapters"]) == {"all16", "rows4"}
        assert set(model_ids(server)) == {"all16", "rows4"}
        gone = post(server, "/generate", {**one, "lora_path": "qv8"})
        assert gone.status_code == 400 and "qv8" in gone.text
        for name in ("all16", "rows4"):
            assert post(server, "/generate", {**one, "lora_path": name}).status_code == 200
