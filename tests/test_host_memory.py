"""Memory on a shared CPU host (issue 28), on the real process tree: a small KV budget bounds
every rank's resident memory whatever the traffic, the start-up line says how much and which flag
changes it, /flush_cache gives the pages back to the OS, outputs stay those of the offline engine,
and the front end alone sheds load when the host is short of memory.

The model is tiny but its KV is wide (64 KiB a token in fp32, 32 KiB on each of two TP ranks), so
a few thousand distinct tokens are hundreds of MB: the traffic below is six times the budget. With
the pool sized by GPU semantics (0.8 of the host, the old CPU default) each rank would keep about
6 x 64 MiB of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch
from server_fixture import Server
from tiny_models import make_tiny_model

from srt.engine import Engine
from srt.memory_watch import MemoryWatch
from srt.sampling_params import SamplingParams

MB = 1 << 20
SPACE_GIB = 0.125  # both ranks together: 64 MiB each, 2048 tokens of 32 KiB
BUDGET_TOKENS = 2048
BUDGET_BYTES_PER_RANK = 64 * MB
# what a rank's RSS may grow beyond the budget: the prefix cache's tree, the Python objects of
# tens of requests, allocator noise (activations are at their peak already at the baseline)
MARGIN = 64 * MB
MAX_NEW = 8
VOCAB = 320


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(200, 300, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def generate_all(server: Server, batch: list[list[int]]) -> list[list[int]]:
    def one(ids: list[int]) -> list[int]:
        r = server.generate(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
            }
        )
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]  # type: ignore[no-any-return]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, batch))


@pytest.fixture(scope="module")
def wide_kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama_wide_kv", tmp_path_factory.mktemp("wide") / "llama_wide_kv")


@pytest.fixture(scope="module")
def server(wide_kv_model: Path, smollm2_dir: Path) -> Iterator[Server]:
    with Server(
        "--model-path",
        str(wide_kv_model),
        "--tokenizer-path",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--cpu-kvcache-space",
        str(SPACE_GIB),
        "--max-running-requests",
        "8",
        "--chunked-prefill-size",
        "512",
        "--max-prefill-tokens",
        "1024",
        "--enable-metrics",
    ) as server:
        yield server


def rank_rss(server: Server) -> dict[str, int]:
    """RSS of each scheduler rank, as /server_info reports it (checked against psutil's reading)."""
    info = requests.get(server.url + "/server_info", timeout=30).json()
    ranks = {p["name"]: p for p in info["memory"]["processes"] if p["name"].startswith("scheduler")}
    assert sorted(ranks) == ["scheduler TP0", "scheduler TP1"], info["memory"]
    for entry in ranks.values():  # the report is the process's own RSS (within what a moment changes)
        assert abs(psutil.Process(entry["pid"]).memory_info().rss - entry["rss_bytes"]) < 16 * MB
    return {name: int(entry["rss_bytes"]) for name, entry in ranks.items()}


def test_startup_line_names_the_budget_and_its_flag(server: Server) -> None:
    lines = [ln for ln in server.output().splitlines() if "KV cache budget" in ln]
    assert len(lines) == 1, lines  # one line, from rank 0
    assert (
        f"KV cache budget: 0.0625 GiB = {BUDGET_TOKENS} tokens per rank, 2 ranks on this host" in lines[0]
    ), lines[0]
    assert (
        "bound by --cpu-kvcache-space 0.125 GiB / 2 local ranks; change it with --cpu-kvcache-space"
        in lines[0]
    )
    assert server.internal_state()["max_total_tokens"] == BUDGET_TOKENS


def test_rss_stays_within_the_budget_and_outputs_are_unchanged(server: Server, wide_kv_model: Path) -> None:
    # Warm-up at the traffic's shape (activations reach their peak), then flush: the baseline
    # holds weights and activations, and none of the KV.
    generate_all(server, prompts(8, seed=1))
    assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200
    baseline = rank_rss(server)

    traffic = prompts(48, seed=2)
    assert sum(map(len, traffic)) > 5 * BUDGET_TOKENS
    outputs = generate_all(server, traffic)
    state = server.internal_state()
    assert state["kv_integrity_error"] is None
    assert state["cached_pages"] <= BUDGET_TOKENS and state["num_pages"] == BUDGET_TOKENS
    after = rank_rss(server)
    for name, rss in after.items():
        grown = rss - baseline[name]
        print(f"{name}: baseline {baseline[name] / MB:.0f} MB, after the traffic +{grown / MB:.0f} MB")
        assert grown <= BUDGET_BYTES_PER_RANK + MARGIN, (
            f"{name} grew {grown / MB:.0f} MB over {sum(map(len, traffic))} distinct tokens; budget "
            f"{BUDGET_BYTES_PER_RANK / MB:.0f} MB + margin {MARGIN / MB:.0f} MB"
        )

    # /flush_cache gives the KV pages' memory back to the OS
    assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200
    flushed = rank_rss(server)
    for name, rss in flushed.items():
        assert rss - baseline[name] <= MARGIN, (name, rss / MB, baseline[name] / MB)
    assert server.internal_state()["free_pages"] == BUDGET_TOKENS

    # The first prompts again, their pages evicted long ago and reused (LIFO, then zeroed): the
    # outputs are those of the offline engine with a pool large enough never to evict.
    engine = Engine(str(wide_kv_model), dtype="float32", max_total_tokens=16384)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    reference = [o.output_ids for o in engine.generate(traffic[:16], params)]
    assert outputs[:16] == reference
    assert generate_all(server, traffic[:16]) == reference


def test_metrics_report_kv_pages_and_every_process_rss(server: Server) -> None:
    text = requests.get(server.url + "/metrics", timeout=30).text
    for series in (
        "srt:kv_free_pages",
        "srt:kv_cached_pages",
        "srt:kv_used_pages",
        "srt:host_available_memory_bytes",
        'srt:process_resident_memory_bytes{process="scheduler TP0"}',
        'srt:process_resident_memory_bytes{process="scheduler TP1"}',
        'srt:process_resident_memory_bytes{process="main"}',
    ):
        assert series in text, series


def test_memory_watch_decides_alone_and_repeats_while_short() -> None:
    readings = iter([5 * MB, 1 * MB, 1 * MB, 1 * MB, 5 * MB])
    watch = MemoryWatch(2 * MB, read=lambda: next(readings))
    assert not watch.poll(0.0) and watch.pressure is None
    assert watch.poll(1.0) and "--min-available-memory" in (watch.pressure or "")  # below: release
    assert not watch.poll(2.0) and watch.pressure is not None  # still below: refused, no second release yet
    assert watch.poll(12.0)  # again after REPEAT_S
    assert not watch.poll(13.0) and watch.pressure is None  # memory back: serving again
    assert not MemoryWatch(0, read=lambda: 0).poll(0.0)  # 0: off


@pytest.mark.slow  # its own server, ~20 s
def test_host_short_of_memory_sheds_new_requests_and_releases_the_cache(
    tiny_model_dirs: dict[str, Path], smollm2_dir: Path
) -> None:
    # A threshold no host meets: the front end is under pressure from its first reading.
    with Server(
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--min-available-memory",
        "1000000",
    ) as server:
        deadline = time.monotonic() + 30
        while "releasing KV memory" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "releasing KV memory" in server.output()  # the rank applied the front end's message
        r = server.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "--min-available-memory 1e+06 GiB" in r.text, r.text
        assert r.headers.get("Retry-After") == "1"  # the condition passes by itself: say when to retry
        chat = requests.post(
            server.url + "/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 503 and chat.headers.get("Retry-After") == "1", chat.text
        assert chat.json()["error"]["type"] == "service_unavailable_error"
        info = requests.get(server.url + "/server_info", timeout=30).json()
        assert "short of memory" in info["memory"]["pressure"]
        assert requests.get(server.url + "/health", timeout=10).status_code == 200  # alive, shedding
