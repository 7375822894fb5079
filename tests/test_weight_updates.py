"""Weight updates from disk, the weights' version, pause and continue (issue 62, first slice): on
one rank's scheduler in-process (scheduler/weight_registry.py with the real ModelRunner) and on a
real server (SGLang's routes and shapes: srt/weights_api.py). The registry on two gloo ranks and
the restart's replay: tests/test_weight_registry.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file
from scheduler_harness import Harness
from server_fixture import Server
from test_guards_e2e import rank_pid
from tiny_models import make_tiny_model

from srt.io_struct import (
    ContinueGenerationReq,
    ControlReply,
    PauseGenerationReq,
    UpdateWeightsFromDiskReq,
)
from srt.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], [7, 7, 7, 7, 7, 100, 101]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A (tiny random Llama), B (A's weights perturbed, same config), and bad ones."""
    root = tmp_path_factory.mktemp("weights")
    a = make_tiny_model("llama", root / "a")
    b = root / "b"
    shutil.copytree(a, b)
    torch.manual_seed(1)
    tensors = load_file(str(a / "model.safetensors"))
    perturbed = {n: t + 0.05 * torch.randn_like(t) if t.dim() > 1 else t for n, t in tensors.items()}
    save_file(perturbed, str(b / "model.safetensors"), metadata={"format": "pt"})
    corrupt = root / "corrupt"  # passes the config check; its file is cut short
    shutil.copytree(a, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    shape = root / "shape"  # a tensor of another shape under the same config
    shutil.copytree(a, shape)
    wrong = dict(tensors)
    wrong["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 96)
    save_file(wrong, str(shape / "model.safetensors"), metadata={"format": "pt"})
    other = root / "other"  # another config (more layers)
    make_tiny_model("llama", other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (other / "config.json").write_text(json.dumps(config))
    return {"a": a, "b": b, "corrupt": corrupt, "shape": shape, "other": other}


def greedy(h: Harness, tag: str) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        h.submit(f"{tag}{i}", prompt, GREEDY)
    h.run_until_idle()
    return [h.tokens[f"{tag}{i}"] for i in range(len(PROMPTS))]


def control(h: Harness, msg: Any) -> ControlReply:
    h.send(msg)
    h.scheduler.step()
    replies = [out for out in h.outputs if isinstance(out, ControlReply)]
    h._collect()
    assert len(replies) == 1, replies
    return replies[0]


def test_an_update_gives_the_tokens_of_a_scheduler_started_on_the_new_weights(
    models: dict[str, Path],
) -> None:
    """A -> B on the bf16 path: the same prompts (cached under A's weights) then give B's tokens,
    token for token; a bad folder fails by its cause and A keeps serving unchanged."""
    h = Harness(models["a"], dtype="bfloat16")
    on_a = greedy(h, "a")
    for bad, cause in [
        ("corrupt", "safetensors"),
        ("shape", "down_proj"),
        ("other", "num_hidden_layers"),
        ("missing", "not a folder"),
    ]:
        reply = control(h, UpdateWeightsFromDiskReq(bad, str(models[bad] if bad in models else "/nope")))
        assert not reply.success and cause in reply.payload["message"], reply
    assert greedy(h, "again") == on_a
    reply = control(h, UpdateWeightsFromDiskReq("u", str(models["b"]), "v2"))
    assert reply.success and reply.payload["weight_version"] == "v2", reply
    on_b = greedy(Harness(models["b"], dtype="bfloat16"), "b")
    assert on_b != on_a  # else the test shows nothing
    assert greedy(h, "after") == on_b
    assert h.integrity_error() is None


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_requests_take_no_step_and_finish_after_an_update_and_continue(
    models: dict[str, Path], mode: str
) -> None:
    h = Harness(models["a"], dtype="bfloat16")
    for i, prompt in enumerate(PROMPTS):
        h.submit(f"r{i}", prompt, GREEDY)
    for _ in range(4):
        h.scheduler.step()
        h._collect()
    held = control(h, PauseGenerationReq("p", mode))
    assert held.payload["num_paused_requests"] == len(PROMPTS)
    if mode == "retract":
        assert not h.scheduler.running and len(h.scheduler.waiting) == len(PROMPTS)
    steps = h.scheduler.forward_steps
    for _ in range(5):
        h.scheduler.step()
    assert h.scheduler.forward_steps == steps and not h.scheduler.has_work()  # idle, not stalled
    assert control(h, UpdateWeightsFromDiskReq("u", str(models["b"]), "v2")).success
    # every token produced before the update went out before its reply (the front end's spans)
    held = h.scheduler.queues.waiting + h.scheduler.queues.live()
    assert held and all(len(h.tokens.get(r.rid, [])) == len(r.output_ids) > 0 for r in held)
    assert control(h, ContinueGenerationReq("c")).success
    h.run_until_idle()
    assert all(len(h.tokens[f"r{i}"]) == GREEDY.max_new_tokens for i in range(len(PROMPTS)))
    assert h.integrity_error() is None
    assert control(h, ContinueGenerationReq("again")).success  # harmless without a pause


# ---- a real server ------------------------------------------------------------------------------


STREAMED = 480  # tokens a stream asks for: long enough to be paused in the middle


def _stream(server: Server, prompt: list[int], out: list[dict[str, Any]]) -> None:
    sampling = {"max_new_tokens": STREAMED, "temperature": 0.0, "ignore_eos": True}
    payload = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))


def test_sglang_routes_pause_update_and_continue_on_a_real_server(
    models: dict[str, Path], smollm2_dir: Path
) -> None:
    """A server on A: bad updates are 400s naming model_path and change nothing; streams paused in
        place, the weights updated to B, continued: every stream completes and reports B's version; then
        the server gives what a scheduler started on B gives, token for token (a fresh server: the slow
    test below)."""
    flags = ("--tokenizer-path", str(smollm2_dir), "--max-total-tokens", "4096")
    with Server("--model-path", str(models["a"]), *flags) as server:
        url = server.url

        def generate(prompt: list[int]) -> tuple[list[int], str]:
            sampling = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
            out = server.generate({"input_ids": prompt, "sampling_params": sampling}).json()
            return out["output_ids"], out["meta_info"]["weight_version"]

        on_a = [generate(p) for p in PROMPTS]
        assert {v for _, v in on_a} == {"default"}
        for path, field in [(models["other"], "num_hidden_layers"), ("/x/model.gguf", "GGUF")]:
            r = requests.post(url + "/update_weights_from_disk", json={"model_path": str(path)}, timeout=60)
            assert (
                r.status_code == 400 and field in r.json()["message"] and "model_path" in r.json()["message"]
            )
        r = requests.post(
            url + "/update_weights_from_disk", json={"model_path": str(models["corrupt"])}, timeout=60
        )
        assert r.status_code == 400 and r.json()["success"] is False
        assert [generate(p) for p in PROMPTS] == on_a
        # streams paused in place, the weights updated, continued: every stream completes
        outs: list[list[dict[str, Any]]] = [[] for _ in PROMPTS]
        threads = [threading.Thread(target=_stream, args=(server, p, o)) for p, o in zip(PROMPTS, outs)]
        for t in threads:
            t.start()
        while not all(outs):  # every stream has its first tokens
            threading.Event().wait(0.05)
        assert requests.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=60).ok
        threading.Event().wait(0.3)  # what was on its way before the pause arrives
        seen = [len(out) for out in outs]
        threading.Event().wait(0.3)
        assert [len(out) for out in outs] == seen  # paused: no stream moves
        body = {"model_path": str(models["b"]), "weight_version": "v2"}
        r = requests.post(url + "/update_weights_from_disk", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["success"] and r.json()["num_paused_requests"] >= 1, r.text
        assert requests.post(url + "/continue_generation", timeout=60).ok
        for t in threads:
            t.join(timeout=120)
        for out in outs:
            spans = out[-1]["meta_info"]["weight_versions"]  # which version produced which tokens
            assert [s["version"] for s in spans] == ["default", "v2"], spans
            assert (
                spans[0]["start"] == 0
                and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == STREAMED
            )
            assert (
                len(out[-1]["output_ids"]) == STREAMED
                and out[-1]["meta_info"]["finish_reason"]["type"] == "length"
            )
            assert out[-1]["meta_info"]["weight_version"] == "v2"
        info = requests.get(url + "/model_info", timeout=30).json()
        assert info["weight_version"] == "v2" and info["model_path"] == str(models["b"])
        on_b = [generate(p) for p in PROMPTS]
        assert {v for _, v in on_b} == {"v2"}
        # `abort` ends the streams in flight; a request sent while paused waits for continue
        aborted: list[dict[str, Any]] = []
        stream = threading.Thread(target=_stream, args=(server, PROMPTS[0], aborted))
        stream.start()
        while not aborted:
            threading.Event().wait(0.05)
        assert requests.post(url + "/pause_generation", json={"mode": "abort"}, timeout=60).ok
        stream.join(timeout=60)
        assert aborted[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        held: list[tuple[list[int], str]] = []
        waiting = threading.Thread(target=lambda: held.append(generate(PROMPTS[0])))
        waiting.start()
        threading.Event().wait(0.5)
        assert not held  # held back at the front end while paused
        assert requests.post(url + "/continue_generation", timeout=60).ok
        waiting.join(timeout=60)
        assert held == on_b[:1]
        # two updates at once: the second waits for the first, both succeed, in some order
        results: dict[str, int] = {}

        def update(folder: Path, version: str) -> None:
            body = {"model_path": str(folder), "weight_version": version}
            results[version] = requests.post(
                url + "/update_weights_from_disk", json=body, timeout=120
            ).status_code

        both = [threading.Thread(target=update, args=a) for a in [(models["a"], "v3"), (models["b"], "v4")]]
        for t in both:
            t.start()
        for t in both:
            t.join(timeout=120)
        assert results == {"v3": 200, "v4": 200}
        last = requests.get(url + "/model_info", timeout=30).json()["weight_version"]
        assert [generate(p)[0] for p in PROMPTS] == [ids for ids, _ in (on_a if last == "v3" else on_b)]
    fresh_b = greedy(Harness(models["b"], dtype="bfloat16"), "b")  # a fresh scheduler on B, in-process
    assert [ids for ids, _ in on_b] == fresh_b != [ids for ids, _ in on_a]


@pytest.mark.slow  # two PP=2 servers and a restart: ~40 s
def test_at_pp2_an_update_survives_a_lost_rank_and_answers_as_a_fresh_server(
    models: dict[str, Path], smollm2_dir: Path
) -> None:
    """PP=2 with --restart-on-failure: after A -> B the server gives what a fresh server on B gives,
    token for token, and still does after its last stage is SIGKILLed (the restart loads B, not
    --model-path's A)."""
    flags = ("--tokenizer-path", str(smollm2_dir), "--max-total-tokens", "4096", "--pp-size", "2")
    flags += ("--restart-on-failure", "1")
    sampling = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}

    def generate(server: Server) -> list[list[int]]:
        return [
            server.generate({"input_ids": p, "sampling_params": sampling}).json()["output_ids"]
            for p in PROMPTS
        ]

    with Server("--model-path", str(models["a"]), *flags) as server:
        on_a = generate(server)
        body = {"model_path": str(models["b"]), "weight_version": "v2"}
        assert requests.post(server.url + "/update_weights_from_disk", json=body, timeout=120).ok
        on_b = generate(server)
        os.kill(rank_pid(server, "srt::scheduler_PP1_TP0"), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "engine restarted in" not in server.output():
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.1)
        after_restart = generate(server)
        info = requests.get(server.url + "/model_info", timeout=30).json()
        assert info["weight_version"] == "v2"
    with Server("--model-path", str(models["b"]), *flags) as fresh:
        fresh_b = generate(fresh)
    assert on_b == fresh_b == after_restart != on_a
