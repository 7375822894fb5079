"""The scheduler in-process on a tiny model: continuous batching, chunked prefill, retraction,
prefix reuse, aborts and KV integrity, checked against the offline engine's greedy outputs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from scheduler_harness import Harness

from scheduler.scheduler import IDLE_WAIT_MS
from srt.engine import Engine
from srt.io_struct import AbortReq, FlushCacheReq
from srt.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def mixed_prompts(n: int, vocab: int = 320) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(3, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def reference(tiny_model_dirs: dict[str, Path]) -> dict[str, list[int]]:
    prompts = mixed_prompts(32)
    engine = Engine(str(tiny_model_dirs["llama"]), dtype="float32", max_total_tokens=8192)
    outs = engine.generate(prompts, GREEDY)
    return {f"r{i}": o.output_ids for i, o in enumerate(outs)}


def test_offline_engine_refuses_what_it_cannot_run_by_name(tiny_model_dirs: dict[str, Path]) -> None:
    """Text where token ids go, and a params list of another length than the prompts (which zip
    would cut short, dropping requests silently), are refused before a step; the engine still runs."""
    engine = Engine(str(tiny_model_dirs["llama"]), dtype="float32", max_total_tokens=1024)
    with pytest.raises(TypeError, match=r"prompts\[1\] is a str: the offline Engine takes token ids"):
        engine.generate([[5, 6], "hello"], GREEDY)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a list of int token ids"):
        engine.generate([[5.0, 6]], GREEDY)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="params: 1 SamplingParams for 2 prompts"):
        engine.generate([[5, 6], [7, 8]], [GREEDY])
    outs = engine.generate([[5, 6], [7, 8]], [GREEDY, GREEDY])
    assert [len(o.output_ids) for o in outs] == [12, 12]


def run(model_dir: Path, **kwargs: object) -> Harness:
    h = Harness(model_dir, **kwargs)  # type: ignore[arg-type]
    for i, p in enumerate(mixed_prompts(32)):
        h.submit(f"r{i}", p, GREEDY)
    h.run_until_idle()
    return h


def test_continuous_batching_matches_offline_engine(
    tiny_model_dirs: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    h = run(tiny_model_dirs["llama"], max_total_tokens=8192)
    assert h.tokens == reference
    assert all(f.type == "length" for f in h.finished.values())
    assert h.integrity_error() is None


def test_chunked_prefill_and_small_budgets(
    tiny_model_dirs: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    h = run(
        tiny_model_dirs["llama"],
        max_total_tokens=8192,
        chunked_prefill_size=16,
        max_prefill_tokens=24,
        max_running_requests=5,
    )
    assert h.tokens == reference
    assert h.integrity_error() is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_kv_budget_retracts_and_still_matches(
    tiny_model_dirs: dict[str, Path], reference: dict[str, list[int]], page_size: int
) -> None:
    h = run(tiny_model_dirs["llama"], max_total_tokens=160, page_size=page_size)
    assert h.tokens == reference
    assert h.integrity_error() is None


def test_retraction_happens_under_pressure(tiny_model_dirs: dict[str, Path]) -> None:
    h = Harness(tiny_model_dirs["llama"], max_total_tokens=100)
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(6)
    for i, p in enumerate(prompts):
        h.submit(f"q{i}", p[:20] or [5], long)
    retracted = False
    for _ in range(2000):
        h.scheduler.step()
        h._collect()
        retracted |= any(r.retractions for r in h.scheduler.waiting)
        if not (h.scheduler.waiting or h.scheduler.running or h.scheduler.chunked_req):
            break
    assert retracted, "the budget was meant to force a retraction"
    engine = Engine(str(tiny_model_dirs["llama"]), dtype="float32", max_total_tokens=4096)
    expected = engine.generate([p[:20] or [5] for p in prompts], long)
    assert [h.tokens[f"q{i}"] for i in range(6)] == [o.output_ids for o in expected]
    assert h.integrity_error() is None


def test_request_that_can_never_fit_is_aborted_alone(tiny_model_dirs: dict[str, Path]) -> None:
    h = Harness(tiny_model_dirs["llama"], max_total_tokens=64)
    h.submit("huge", list(range(3, 100)), GREEDY)
    h.submit("grows", [5, 6, 7], SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True))
    h.submit("ok", [5, 6, 7], GREEDY)
    h.run_until_idle()
    assert h.finished["huge"].type == "abort" and "cannot fit" in h.finished["huge"].message
    assert h.finished["grows"].type == "abort" and "more KV cache" in h.finished["grows"].message
    assert h.finished["ok"].type == "length" and len(h.tokens["ok"]) == 12
    assert h.integrity_error() is None


def test_prefix_cache_reports_cached_tokens(tiny_model_dirs: dict[str, Path]) -> None:
    h = Harness(tiny_model_dirs["llama"], max_total_tokens=4096)
    prefix = mixed_prompts(1)[0] * 2
    h.submit("first", prefix + [7, 8], GREEDY)
    h.run_until_idle()
    h.submit("second", prefix + [7, 8], GREEDY)
    h.run_until_idle()
    assert h.meta["first"]["cached_tokens"] == 0
    assert h.meta["second"]["cached_tokens"] == len(prefix) + 1
    assert h.tokens["second"] == h.tokens["first"]
    assert h.integrity_error() is None
    h.send(FlushCacheReq("f1"))
    h.run_until_idle()
    assert h.scheduler.tree_cache.total_size() == 0
    assert h.runner.allocator.num_free_tokens == h.runner.max_total_tokens


@pytest.mark.parametrize("micro_batches", [0, 2])  # 0: the plain loop; 2: aborts reach batches in flight
def test_aborts_free_everything(tiny_model_dirs: dict[str, Path], micro_batches: int) -> None:
    h = Harness(
        tiny_model_dirs["llama"], micro_batches=micro_batches, max_total_tokens=4096, chunked_prefill_size=8
    )
    long = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(mixed_prompts(6)):
        h.submit(f"a{i}", p, long)
    for _ in range(7):
        h.scheduler.step()
    if micro_batches:
        assert any(b is not None for b in h.scheduler.in_flight)  # type: ignore[attr-defined]
    for i in range(6):
        h.send(AbortReq(f"a{i}"))
    h.run_until_idle()
    assert all(h.finished[f"a{i}"].type == "abort" for i in range(6))
    assert h.integrity_error() is None
    assert h.scheduler.tree_cache.protected_size() == 0


def test_radix_cache_disabled_matches(
    tiny_model_dirs: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    h = run(tiny_model_dirs["llama"], max_total_tokens=8192, disable_radix_cache=True)
    assert h.tokens == reference
    assert h.integrity_error() is None
    assert h.runner.allocator.num_free_tokens == h.runner.max_total_tokens


@pytest.mark.parametrize(("policy", "lookups_per_request"), [("fcfs", 1), ("lpm", 2)])
def test_admission_looks_the_prefix_up_once(
    tiny_model_dirs: dict[str, Path], policy: str, lookups_per_request: int
) -> None:
    """The lookup that sized a request's prefill is the one `admit` locks: no second match per
    request (lpm ordering needs one more, to sort)."""
    h = Harness(tiny_model_dirs["llama"], max_total_tokens=4096, schedule_policy=policy)
    cache = h.scheduler.tree_cache
    lookups: list[int] = []
    real = cache.match_prefix
    cache.match_prefix = lambda ids, ns: (lookups.append(len(ids)), real(ids, ns))[1]  # type: ignore[method-assign]
    for i, prompt in enumerate(mixed_prompts(3)):
        h.submit(f"r{i}", prompt, GREEDY)
    h.scheduler.step()  # one prefill step admits all three
    assert len(h.scheduler.running) == 3
    assert len(lookups) == 3 * lookups_per_request


def test_step_timer_counts_only_steps_that_began_busy_and_ran_a_batch(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """The receive of a step that began idle includes rank 0's deliberate wait on its socket; it
    must not count as control-plane time. Busy steps split into broadcast, scheduling, forward."""
    h = Harness(tiny_model_dirs["llama"], max_total_tokens=4096)
    fake_recv = h.receiver.recv
    busy_recv_s = 0.002

    def recv(wait_ms: int) -> list[Any]:
        time.sleep(wait_ms / 1000 if wait_ms else busy_recv_s)  # like rank 0's poll, then the broadcast
        return fake_recv(wait_ms)

    h.receiver.recv = recv  # type: ignore[method-assign]
    timer = h.scheduler.stats.timer
    for _ in range(2):
        h.scheduler.step()
    assert timer.as_dict() == {"steps": 0, "broadcast_s": 0.0, "schedule_s": 0.0, "forward_s": 0.0}
    for i, prompt in enumerate(mixed_prompts(3)):
        h.submit(f"r{i}", prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    h.run_until_idle()
    wall = time.perf_counter() - start
    steps = h.scheduler.forward_steps
    assert steps >= 6
    assert timer.steps == steps - 1  # the first batch ran in a step that began idle
    assert busy_recv_s * timer.steps <= timer.broadcast_s < IDLE_WAIT_MS / 1000  # no idle wait in it
    assert timer.schedule_s > 0 and timer.forward_s > 0
    assert timer.broadcast_s + timer.schedule_s + timer.forward_s < wall
    counted = timer.as_dict()
    assert h.scheduler.internal_state()["step_timing"] == counted
    h.scheduler.step()  # idle again: nothing more counts
    assert timer.as_dict() == counted


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_pipeline_loop_matches_offline_engine(
    tiny_model_dirs: dict[str, Path], reference: dict[str, list[int]], micro_batches: int
) -> None:
    """The pipeline stages' loop (scheduler/pipeline.py) on one stage, tokens coming back
    `micro_batches` iterations late: same greedy tokens with plain, chunked and tiny-KV budgets,
    with the micro-batches really in flight together and never sharing a request."""
    budgets: list[dict[str, Any]] = [
        {"max_total_tokens": 8192},
        {
            "max_total_tokens": 8192,
            "chunked_prefill_size": 16,
            "max_prefill_tokens": 24,
            "max_running_requests": 5,
        },
        {"max_total_tokens": 160},
    ]
    for budget in budgets:
        h = Harness(tiny_model_dirs["llama"], micro_batches=micro_batches, **budget)
        for i, p in enumerate(mixed_prompts(32)):
            h.submit(f"r{i}", p, GREEDY)
        most_in_flight = 0
        for _ in range(10_000):
            h.scheduler.step()
            h._collect()
            launched = [b for b in h.scheduler.in_flight if b is not None]  # type: ignore[attr-defined]
            # (a prompt's chunks may follow each other at once: only a sampled token must come back first)
            rids = [r.rid for b in launched for r, sampled in zip(b.batch.reqs, b.sampled) if sampled]
            assert len(rids) == len(set(rids)), "a request waits for two tokens at once"
            most_in_flight = max(most_in_flight, len(launched))
            if not h.scheduler.has_work():
                break
        assert h.tokens == reference, budget
        assert h.integrity_error() is None
        assert most_in_flight == micro_batches
