"""Rank consensus: stable digests, the decorator's events, and divergence found across spawned gloo ranks."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import queue
import subprocess
import sys
import time
import timeit
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import consensus
from consensus import LOG, rank_consensus, record, set_enabled
from consensus.canonical import canonical, event_digest, window_digest
from srt.utils import free_port


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass
class Plan:
    rids: list[str]
    phase: Phase


class FakeScheduler:
    @rank_consensus
    def schedule(self) -> None:
        pass

    @rank_consensus(args=("rid", "num_tokens"), result=True)
    def admit(self, rid: str, num_tokens: int, priority: int = 0) -> bool:
        return num_tokens < 100

    @rank_consensus(args={"plan": lambda p: p.rids}, result=lambda out: out.phase)
    def run_batch(self, plan: Plan, note: str = "") -> Plan:
        return plan

    @rank_consensus(args=("num_tokens",), result=True, name="admit_or_raise")
    def must_fit(self, num_tokens: int) -> int:
        if num_tokens > 10:
            raise ValueError("too big")
        return num_tokens


@pytest.fixture(autouse=True)
def fresh_log() -> Iterator[None]:
    LOG.clear()
    set_enabled(True)
    yield
    set_enabled(False)
    LOG.clear()


def events() -> list[tuple[str, str]]:
    return [(e.name, e.text) for e in LOG.window(0, LOG.count)]


# --- digests -------------------------------------------------------------------------------------


def test_digests_are_fixed_values_not_salted_hashes() -> None:
    # Golden values: a salted hash() or an address in a repr would change them per process.
    assert (
        event_digest("admit", canonical({"rid": "r7", "num_tokens": 8, "return": True}))
        == 4318864359100872945
    )
    assert window_digest(3, [1, -2]) == 1074696062374389040


def test_canonical_text_of_supported_payloads() -> None:
    assert canonical([1, "a", (2.5, None), True]) == "[1,'a',(2.5,None,),True]"
    assert canonical(Phase.DECODE) == "Phase.DECODE"
    assert canonical({"b", "a", "c"}) == canonical({"c", "a", "b"}) == "{'a','b','c'}"
    assert canonical({"x": 1, "y": 2}) != canonical({"y": 2, "x": 1})  # iteration order is what ranks act on
    assert canonical(0.1 + 0.2) != canonical(0.3)  # exact, not rounded
    assert canonical(Plan(["r1"], Phase.PREFILL)) == "Plan(rids=['r1'],phase=Phase.PREFILL)"
    assert canonical(torch.tensor([1, 2])) == "Tensor:[1,2]"


def test_objects_without_a_stable_text_are_rejected() -> None:
    with pytest.raises(TypeError, match="no stable canonical form"):
        canonical([object()])


# --- event log and decorator ---------------------------------------------------------------------


def test_bare_decorator_records_call_order() -> None:
    s = FakeScheduler()
    s.schedule()
    s.admit("r1", 5)
    s.schedule()
    assert [name for name, _ in events()] == [
        "FakeScheduler.schedule",
        "FakeScheduler.admit",
        "FakeScheduler.schedule",
    ]
    assert [e.seq for e in LOG.window(0, 3)] == [0, 1, 2]


def test_selectors_record_named_arguments_and_result() -> None:
    s = FakeScheduler()
    s.admit("r1", 5)
    s.admit(num_tokens=500, rid="r2", priority=3)
    s.run_batch(Plan(["r1", "r2"], Phase.DECODE), note="ignored")
    assert events() == [
        ("FakeScheduler.admit", "{'rid':'r1','num_tokens':5,'return':True}"),
        ("FakeScheduler.admit", "{'rid':'r2','num_tokens':500,'return':False}"),
        ("FakeScheduler.run_batch", "{'plan':['r1','r2'],'return':Phase.DECODE}"),
    ]


def test_an_exception_is_recorded_and_propagates() -> None:
    with pytest.raises(ValueError):
        FakeScheduler().must_fit(11)
    assert events() == [("admit_or_raise", "{'num_tokens':11,'raise':'ValueError'}")]


def test_bad_selectors_fail_at_decoration_time() -> None:
    with pytest.raises(ValueError, match="'nope', which is not a parameter"):
        rank_consensus(args=("nope",))(lambda a: a)
    with pytest.raises(TypeError, match="sequence of parameter names"):
        rank_consensus(args="a")(lambda a: a)


def test_disabled_path_records_nothing_and_costs_little() -> None:
    set_enabled(False)
    s = FakeScheduler()
    s.schedule()
    assert s.admit("r1", 5) is True
    record("manual", [1, 2])
    assert LOG.count == 0

    def plain(a: int, b: int = 1) -> int:
        return a

    wrapped = rank_consensus(args=("a",), result=True)(plain)
    n = 20000
    direct = min(timeit.repeat(lambda: plain(1, b=2), number=n, repeat=5)) / n
    through = min(timeit.repeat(lambda: wrapped(1, b=2), number=n, repeat=5)) / n
    assert through - direct < 3e-6, (
        f"disabled @rank_consensus costs {(through - direct) * 1e6:.2f} us per call"
    )
    assert LOG.count == 0


def test_window_and_trimming_of_the_log() -> None:
    for i in range(5):
        record("e", i)
    LOG.drop_before(3)
    assert (LOG.count, LOG.held) == (5, 2)
    assert [e.seq for e in LOG.window(3, 5)] == [3, 4]
    with pytest.raises(IndexError):
        LOG.window(2, 5)


def test_single_rank_enable_stays_off() -> None:
    set_enabled(False)
    checker = consensus.enable(consensus.create_groups(1, 1, 0))
    try:
        assert not consensus.is_enabled() and not checker.running
        FakeScheduler().schedule()
        assert LOG.count == 0
    finally:
        assert consensus.disable()


def test_create_groups_rejects_a_bad_rank() -> None:
    with pytest.raises(ValueError, match="world_rank 4 outside"):
        consensus.create_groups(2, 2, 4)


# --- spawned gloo ranks --------------------------------------------------------------------------


def _agree_phase(rank: int, q: Any) -> None:
    """Identical events, background thread: several clean cycles, then a stop asked by rank 0 only."""
    checker = consensus.enable(
        _GROUPS[0], interval_s=0.05, on_divergence=lambda m: q.put((rank, "divergence", m))
    )
    s = FakeScheduler()
    for step in range(8):
        s.schedule()
        s.admit(f"r{step}", step)
        s.run_batch(Plan([f"r{step}"], Phase.PREFILL))
        time.sleep(0.03)
    total = LOG.count
    deadline = time.monotonic() + 15
    while min(checker.checked_upto.values()) < total and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.barrier()  # main thread, default group, while the checker threads run on their own groups
    checked, held, cycles = checker.checked_upto, LOG.held, checker.cycles
    if rank == 0:
        stopped = consensus.disable()
    else:  # the peers' threads leave at the same stop vote without being asked locally
        deadline = time.monotonic() + 5
        while checker.running and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped = not checker.running and consensus.disable(timeout_s=0.1)
    q.put(
        (
            rank,
            "agreed",
            {"total": total, "checked": checked, "held": held, "cycles": cycles, "stopped": stopped},
        )
    )


def _payload_divergence_phase(rank: int, q: Any) -> None:
    """Rank 1 admits r7 with a different token count; the background thread must notice."""
    checker = consensus.enable(
        _GROUPS[0], interval_s=0.05, on_divergence=lambda m: q.put((rank, "divergence", m))
    )
    s = FakeScheduler()
    for i in range(12):
        s.admit(f"r{i}", 9 if (rank == 1 and i == 7) else 8)
        time.sleep(0.01)
    deadline = time.monotonic() + 15
    while not checker.diverged and time.monotonic() < deadline:
        time.sleep(0.02)
    consensus.disable(timeout_s=1)


def _gate_phase(rank: int, q: Any) -> None:
    """The main thread's per-step gate: the same batch passes; different batches stop the step
    before it runs, and the thread names the divergence."""
    consensus.enable(_GROUPS[0], interval_s=0.05, on_divergence=lambda m: q.put((rank, "gate divergence", m)))
    s = FakeScheduler()
    s.admit("g0", 4)
    consensus.agree_before_step(("prefill", ["g0"], [4]))
    tokens = 4 if rank == 0 else 5
    s.admit("g1", tokens)
    try:
        consensus.agree_before_step(("prefill", ["g1"], [tokens]))
        q.put((rank, "gate", "passed"))
    except RuntimeError as error:
        q.put((rank, "gate", str(error)))
    consensus.disable(timeout_s=1)


def _order_divergence_phase(rank: int, q: Any, release: Any) -> None:
    """Rank 1 runs a batch before scheduling at step 3. Only TP group {0, 1} checks (check_now);
    ranks 2 and 3 take part in no collective, so the TP group needs nobody else."""
    checker = consensus.enable(
        _GROUPS[0], on_divergence=lambda m: q.put((rank, "divergence", m)), start=False
    )
    s = FakeScheduler()
    for step in range(5):
        calls = [s.schedule, lambda: s.run_batch(Plan(["r0"], Phase.DECODE))]
        for call in reversed(calls) if (rank == 1 and step == 3) else calls:
            call()
    if rank in (0, 1):
        q.put((rank, "check_now", checker.check_now()))
    else:
        release.wait(20)
    consensus.disable(timeout_s=1)


_GROUPS: list[consensus.ConsensusGroups] = []


def _rank_main(rank: int, tp: int, pp: int, port: int, q: Any, release: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=tp * pp,
            rank=rank,
            timeout=datetime.timedelta(seconds=30),
        )
        _GROUPS.append(consensus.create_groups(tp, pp, rank, timeout_s=20))
        _agree_phase(rank, q)
        if pp == 1:
            _payload_divergence_phase(rank, q)
            _gate_phase(rank, q)
        else:
            _order_divergence_phase(rank, q, release)
        q.put((rank, "done", None))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)  # skip process-group teardown; a stopped peer must not make it wait


def _run_ranks(tp: int, pp: int, timeout_s: float = 60.0) -> dict[tuple[int, str], Any]:
    ctx = mp.get_context("spawn")
    q, release = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, tp, pp, port, q, release), daemon=True)
        for r in range(tp * pp)
    ]
    for p in procs:
        p.start()
    results: dict[tuple[int, str], Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while (
            sum(key[1] in ("done", "error") for key in results) < len(procs) and time.monotonic() < deadline
        ):
            try:
                rank, kind, value = q.get(timeout=0.5)
            except queue.Empty:
                continue
            assert kind != "error", f"rank {rank} failed:\n{value}"
            assert (rank, kind) not in results, f"rank {rank} sent {kind} twice"
            results[(rank, kind)] = value
            if (0, "check_now") in results and (1, "check_now") in results:
                release.set()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    assert all((r, "done") in results for r in range(len(procs))), (
        f"ranks did not finish in time: {sorted(results)}"
    )
    return results


def _assert_agreed(results: dict[tuple[int, str], Any], world_size: int, num_groups: int) -> None:
    for rank in range(world_size):
        agreed = results[(rank, "agreed")]
        assert agreed["total"] == 24
        assert list(agreed["checked"].values()) == [24] * num_groups
        assert agreed["held"] == 0  # compared events leave memory
        assert agreed["cycles"] >= 3
        assert agreed["stopped"] is True


def test_two_ranks_agree_then_detect_a_different_payload() -> None:
    results = _run_ranks(tp=2, pp=1)
    _assert_agreed(results, 2, 1)
    messages = [results[(r, "divergence")] for r in (0, 1)]
    for message in messages:
        assert "divergence in the TP group (world ranks [0, 1])" in message
        assert "first diverging event #7" in message
        assert ">> #7 FakeScheduler.admit {'rid':'r7','num_tokens':8,'return':True}" in message
        assert ">> #7 FakeScheduler.admit {'rid':'r7','num_tokens':9,'return':True}" in message
    assert "world rank 0 (this rank)" in messages[0] and "world rank 1 (this rank)" in messages[1]
    for rank in (0, 1):  # the per-step gate stopped both before the step, and the thread named why
        assert (
            results[(rank, "gate")]
            == "TP ranks scheduled different batches (the rank consensus gate stopped the step)"
        )
        assert (
            ">> #1 FakeScheduler.admit {'rid':'g1','num_tokens':5,'return':True}"
            in results[(rank, "gate divergence")]
        )


def test_four_ranks_agree_then_one_tp_group_detects_a_different_call_order() -> None:
    results = _run_ranks(tp=2, pp=2)
    _assert_agreed(results, 4, 2)
    assert results[(0, "check_now")] is False and results[(1, "check_now")] is False
    assert not any(kind == "divergence" and rank in (2, 3) for rank, kind in results)
    for rank in (0, 1):
        message = results[(rank, "divergence")]
        assert "TP group (world ranks [0, 1])" in message and "first diverging event #6" in message
        assert ">> #6 FakeScheduler.schedule None" in message
        assert ">> #6 FakeScheduler.run_batch {'plan':['r0'],'return':Phase.DECODE}" in message


def test_default_on_divergence_flushes_logs_and_exits_70() -> None:
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "from consensus import exit_on_divergence\n"
        "logging.getLogger('srt.consensus').critical('rank consensus divergence at #3')\n"
        "exit_on_divergence('rank consensus divergence at #3')\n"
        "raise SystemExit(0)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == consensus.DIVERGENCE_EXIT_CODE == 70
    assert "rank consensus divergence at #3" in proc.stderr
