from __future__ import annotations

import os
import pickle
import re

import pytest

from launcher.layout import (
    RankInfo,
    local_ranks,
    node_of_world_rank,
    output_world_rank,
    resolve_init_method,
)


def test_single_node_tp() -> None:
    ranks = local_ranks(tp_size=4, pp_size=1)
    assert [(r.tp_rank, r.pp_rank, r.world_rank, r.local_index) for r in ranks] == [
        (0, 0, 0, 0),
        (1, 0, 1, 1),
        (2, 0, 2, 2),
        (3, 0, 3, 3),
    ]
    assert [r.title for r in ranks] == [f"srt::scheduler_TP{t}" for t in range(4)]
    assert ranks[1].name == "scheduler TP1"
    assert [r.is_input_rank for r in ranks] == [True, False, False, False]
    assert [r.is_output_rank for r in ranks] == [True, False, False, False]
    assert all(r.device == "cpu" and r.device_id is None and r.local_world_size == 4 for r in ranks)


def test_pipeline_titles_and_output_rank() -> None:
    ranks = local_ranks(tp_size=2, pp_size=3)
    assert [(r.pp_rank, r.tp_rank) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert ranks[3].title == "srt::scheduler_PP1_TP1"
    assert ranks[3].name == "scheduler PP1 TP1"
    assert output_world_rank(2, 3) == 4
    assert [r.world_rank for r in ranks if r.is_output_rank] == [4]
    assert [r.world_rank for r in ranks if r.is_input_rank] == [0]


@pytest.mark.parametrize("tp,pp,nnodes", [(4, 1, 2), (2, 2, 2), (2, 4, 4), (8, 2, 4), (1, 3, 3)])
def test_nodes_hold_contiguous_blocks(tp: int, pp: int, nnodes: int) -> None:
    world = tp * pp
    seen: list[int] = []
    for node in range(nnodes):
        ranks = local_ranks(tp, pp, nnodes, node, device_type="cuda")
        assert len(ranks) == world // nnodes
        assert [r.local_index for r in ranks] == list(range(len(ranks)))
        assert [r.device for r in ranks] == [f"cuda:{i}" for i in range(len(ranks))]
        assert all(node_of_world_rank(r.world_rank, world, nnodes) == node for r in ranks)
        assert all(r.world_rank == tp * r.pp_rank + r.tp_rank for r in ranks)
        seen += [r.world_rank for r in ranks]
    assert seen == list(range(world))  # every rank exactly once, in order


def test_output_rank_on_last_node_input_rank_on_first() -> None:
    node0 = local_ranks(2, 2, nnodes=2, node_rank=0)
    node1 = local_ranks(2, 2, nnodes=2, node_rank=1)
    assert any(r.is_input_rank for r in node0) and not any(r.is_output_rank for r in node0)
    assert [r.title for r in node1 if r.is_output_rank] == ["srt::scheduler_PP1_TP0"]


def test_rank_info_pickles() -> None:  # it crosses the spawn boundary
    info = local_ranks(2, 2, 2, 1)[1]
    assert pickle.loads(pickle.dumps(info)) == info


@pytest.mark.parametrize(
    "args,match",
    [
        ((0, 1, 1, 0), "--tp-size must be positive"),
        ((3, 1, 2, 0), "not divisible by --nnodes 2"),
        ((2, 1, 2, 2), r"--node-rank 2 is outside \[0, --nnodes 2\)"),
    ],
)
def test_bad_layout_names_the_flag(args: tuple[int, int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        local_ranks(*args)


def test_rank_info_checks_its_invariants() -> None:
    with pytest.raises(AssertionError):
        RankInfo(
            tp_rank=2,
            pp_rank=0,
            tp_size=2,
            pp_size=1,
            node_rank=0,
            nnodes=1,
            local_index=0,
            local_world_size=2,
            device_type="cpu",
        )


def test_resolve_init_method() -> None:
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", resolve_init_method(None, 1))
    assert resolve_init_method("10.0.0.1:5000", 2) == "tcp://10.0.0.1:5000"
    assert resolve_init_method("node-a.example:29500", 2) == "tcp://node-a.example:29500"
    assert resolve_init_method("[::1]:5000", 2) == "tcp://[::1]:5000"
    assert resolve_init_method("env://", 4) == "env://"
    assert resolve_init_method("tcp://h:1", 2) == "tcp://h:1"


@pytest.mark.parametrize("addr", ["10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000", ":5000", "h:port"])
def test_resolve_init_method_rejects(addr: str) -> None:
    with pytest.raises(ValueError, match="--dist-init-addr"):
        resolve_init_method(addr, 2)
    with pytest.raises(ValueError, match="--dist-init-addr HOST:PORT is required"):
        resolve_init_method(None, 2)


def test_threads_per_rank_count_the_cpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from srt.utils import threads_per_rank

    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the host; a cpuset or taskset allows fewer
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7}, raising=False)
    assert [threads_per_rank(n) for n in (1, 2, 4, 8)] == [4, 2, 1, 1]


def test_cpu_threads_gives_every_rank_that_many_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from srt.utils import rank_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert rank_cpus(2, environ={}) == [(2, None), (2, None)]  # the default: the usable CPUs shared out
    assert rank_cpus(2, cpu_threads=1, environ={}) == [(1, None), (1, None)]
    assert rank_cpus(1, cpu_threads=8, environ={}) == [(8, None)]  # oversubscribing is the user's call


@pytest.mark.parametrize(
    ("value", "groups"),
    [("0-1|2-3", [{0, 1}, {2, 3}]), ("3|0", [{3}, {0}]), (" 0-1,3 | 2 ", [{0, 1, 3}, {2}]), ("1-1", [{1}])],
)
def test_sglang_cpu_binding_pins_each_rank_to_its_range(
    value: str, groups: list[set[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from srt.utils import parse_cpu_binding, rank_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert parse_cpu_binding(value) == groups
    env = {"SGLANG_CPU_OMP_THREADS_BIND": value}
    assert rank_cpus(len(groups), environ=env) == [(len(g), frozenset(g)) for g in groups]
    assert rank_cpus(len(groups), cpu_threads=1, environ=env) == [(1, frozenset(g)) for g in groups]


@pytest.mark.parametrize(
    ("value", "ranks", "match"),
    [
        ("0-1|", 2, "cannot read '' as a CPU"),
        ("a-b", 1, "cannot read 'a-b'"),
        ("3-1", 1, "cannot read '3-1'"),
        ("-1", 1, "cannot read '-1'"),
        ("0-1|2-3", 1, "has 2 CPU range.s. for the 1 rank.s."),
        ("0", 2, "has 1 CPU range.s. for the 2 rank.s."),
        ("0|9", 2, r"names CPU.s. \[9\] this process may not run on"),
    ],
)
def test_a_bad_cpu_binding_names_the_variable(
    value: str, ranks: int, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from srt.utils import rank_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    with pytest.raises(ValueError, match=r"SGLANG_CPU_OMP_THREADS_BIND=.*" + match):
        rank_cpus(ranks, environ={"SGLANG_CPU_OMP_THREADS_BIND": value})
