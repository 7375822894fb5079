"""Two `launch_server` nodes on loopback: they serve what one node serves, follow each other's
lifetime, and every misconfiguration ends with a non-zero exit and a message naming it.

The rendezvous and lifetime tests on fake ranks (tests/launcher_targets.py) start in seconds; the
serving tests run the real server on the tiny Llama (fp32, TP=2 split over two nodes)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from server_fixture import Server
from tiny_models import hf_float32, hf_greedy

from launcher.fingerprint import fingerprint_diff, launch_fingerprint
from launcher.layout import RendezvousAddress, check_device_count, rendezvous_address
from launcher.peers import HEARTBEAT_S, LOST_AFTER_S, PeerWatch
from launcher.rendezvous import Rendezvous, RendezvousError
from srt.cli_args import parse_server_args
from srt.launch_server import plan_launch
from srt.server_args import ServerArgs
from srt.server_process import kill_all
from srt.utils import free_port

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
HOST = socket.gethostname()


class Node:
    """One node: `launch_server` (or, with fake=True, launch_server's flow on fake ranks and a
    fake front end), its output in a log file, killed with its process tree at the end."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        args: list[str],
        fake: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        entry = [str(TESTS / "launcher_targets.py"), "node"] if fake else ["-m", "srt.launch_server"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, *entry, *args],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**ENV, **(env or {})},
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait(self, timeout: float) -> int:
        """The exit code; fails the test (with the log) when the node is still running."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node still running after {timeout} s:\n{self.output()[-3000:]}") from None

    def tree(self) -> list[psutil.Process]:
        try:
            return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        kill_all(self.tree())
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.close()


def two_node_args(dist_port: int, node_rank: int, *extra: str) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--tp-size",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{dist_port}",
        "--port",
        str(free_port(avoid=dist_port)),  # never the rendezvous port: node 0 needs both
        *extra,
    ]


def fake_node(nodes: list[Node], tmp_path: Path, name: str, args: list[str], fake: str = "") -> Node:
    node = Node(tmp_path, name, args, fake=True, env={"SRT_TEST_FAKE": fake})
    nodes.append(node)
    return node


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def wait_healthy(node: Node, port: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert node.proc.poll() is None, node.output()[-3000:]
        try:
            if http_status(port, "/health") == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"node 0 not healthy within {timeout} s:\n{node.output()[-3000:]}")


def wait_for_line(node: Node, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in node.output():
        assert node.proc.poll() is None and time.monotonic() < deadline, node.output()[-3000:]
        time.sleep(0.1)


def http_port(node: Node) -> int:
    args = node.proc.args
    assert isinstance(args, list)
    return int(args[args.index("--port") + 1])


# ---- pieces, in process ----


def test_rendezvous_address_from_flag_or_environment() -> None:
    assert str(rendezvous_address("tcp://10.0.0.1:5000", {})) == "--dist-init-addr 10.0.0.1:5000"
    assert str(rendezvous_address("tcp://[::1]:5000", {})) == "--dist-init-addr [::1]:5000"
    env = rendezvous_address("env://", {"MASTER_ADDR": "leader.svc", "MASTER_PORT": "29500"})
    assert (env.host, env.port, str(env)) == ("leader.svc", 29500, "MASTER_ADDR:MASTER_PORT leader.svc:29500")
    with pytest.raises(ValueError, match="env:// needs MASTER_PORT"):
        rendezvous_address("env://", {"MASTER_ADDR": "leader.svc"})
    with pytest.raises(ValueError, match="MASTER_PORT must be a port"):
        rendezvous_address("env://", {"MASTER_ADDR": "a", "MASTER_PORT": "http"})


def test_device_count_check_names_the_remedy() -> None:
    check_device_count(4, 8, nnodes=2)
    with pytest.raises(ValueError, match=r"this node runs 4 ranks .* but has 2 CUDA devices; .*\(--nnodes\)"):
        check_device_count(4, 2, nnodes=1)


def test_fingerprint_names_only_what_differs(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text("{}")
    a = launch_fingerprint(ServerArgs(tp_size=2, dtype="float32"), model_dir)
    assert (
        fingerprint_diff(a, launch_fingerprint(ServerArgs(tp_size=2, dtype="float32", port=1234), copy), 0, 1)
        == []
    )
    b = launch_fingerprint(ServerArgs(tp_size=4, dtype="float32", page_size=16), model_dir)
    assert fingerprint_diff(a, b, 0, 1) == [
        "page_size (node 0: 1, node 1: 16)",
        "tp_size (node 0: 2, node 1: 4)",
    ]
    (copy / "model.safetensors").write_bytes(b"x")
    assert [
        d.split(" ")[0]
        for d in fingerprint_diff(a, launch_fingerprint(ServerArgs(tp_size=2, dtype="float32"), copy), 0, 1)
    ] == ["model"]
    # speculation changes a verify step's rows (a collective's shape), a draft model its drafts
    ngram = launch_fingerprint(
        ServerArgs(tp_size=2, dtype="float32", speculative_algorithm="NGRAM"), model_dir
    )
    assert fingerprint_diff(a, ngram, 0, 1) == ["speculative_algorithm (node 0: None, node 1: NGRAM)"]
    drafting = {"speculative_algorithm": "STANDALONE", "tp_size": 2, "dtype": "float32"}
    mine = launch_fingerprint(ServerArgs(**drafting, speculative_draft_model_path=str(model_dir)), model_dir)
    theirs = launch_fingerprint(ServerArgs(**drafting, speculative_draft_model_path=str(copy)), model_dir)
    assert [d.split(" ")[0] for d in fingerprint_diff(mine, theirs, 0, 1)] == ["draft_model"]


@pytest.fixture
def store_pair() -> Iterator[tuple[Any, list[Rendezvous]]]:
    """Node 0 and node 1 of one server at an in-process store (the launchers' view of it)."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = RendezvousAddress("127.0.0.1", server.port, "--dist-init-addr")
    clients = [TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(2)]
    yield server, [Rendezvous(clients[k], None, k, 2, address) for k in range(2)]


def test_peer_watch_names_the_node_that_went_first(store_pair: tuple[Any, list[Rendezvous]]) -> None:
    _, (node0, node1) = store_pair
    watch0, watch1 = PeerWatch(node0).start(), PeerWatch(node1).start()
    time.sleep(3 * HEARTBEAT_S)
    assert watch0.explain("scheduler TP0 (pid 1) exited with code 1") is None  # node 1 still beats
    assert watch1.failures.poll(5 * HEARTBEAT_S) and watch1.failures.recv() == (
        "node 0 went down (scheduler TP0 (pid 1) exited with code 1)"
    )  # node 1's supervisor gets this
    assert watch1.explain("scheduler TP1 (pid 2) exited with code 1") == (  # or its rank dies first
        "node 0 went down first (scheduler TP0 (pid 1) exited with code 1)"
    )


def test_peer_watch_names_a_silent_node(store_pair: tuple[Any, list[Rendezvous]]) -> None:
    _, (node0, _) = store_pair  # node 1 never beats: its launcher was killed
    start = time.monotonic()
    assert PeerWatch(node0).start().explain("scheduler TP0 (pid 1) exited with code 1") == (
        f"node 1 is gone (no heartbeat for {LOST_AFTER_S:g} s)"
    )
    assert LOST_AFTER_S <= time.monotonic() - start < LOST_AFTER_S + 2


def test_peer_watch_carries_engine_starts_between_the_nodes(store_pair: tuple[Any, list[Rendezvous]]) -> None:
    """--restart-on-failure's handshake (srt/recovery.py): node 1 asks, node 0 begins a start and
    node 1 gets it; a start node 0 begins on its own wakes node 1; a spent budget reaches node 1."""
    _, (node0, node1) = store_pair
    watch0, watch1 = PeerWatch(node0).start(), PeerWatch(node1).start()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(watch1.await_start, "scheduler TP1 (pid 2) was killed by signal SIGKILL", 20)
        assert watch0.restarts.poll(5) and watch0.restarts.recv() == (
            "node 1 asks for a restart (scheduler TP1 (pid 2) was killed by signal SIGKILL)"
        )  # node 0's Supervisor gets this while its own ranks still run
        watch0.begin_start(1, "node 1 asks for a restart")
        assert asked.result(5) == 1
    watch0.enter(1)
    watch1.enter(1)
    assert not watch0.restarts.poll(3 * HEARTBEAT_S)  # node 1's request is met: not signalled again
    assert not watch1.restarts.poll(3 * HEARTBEAT_S)  # node 1 has joined start 1 already
    watch0.begin_start(2, "scheduler TP0 (pid 3) exited with code 1")
    assert watch1.restarts.poll(5) and watch1.restarts.recv() == (
        "node 0 restarts the engine (scheduler TP0 (pid 3) exited with code 1)"
    )
    watch0.enter(2)
    watch1.enter(2)
    watch0.announce("scheduler TP0 (pid 4) exited with code 1; no restart left")  # waits until node 1 heard
    assert watch1.await_start("scheduler TP1 (pid 5) exited with code 1", 20) == (
        "node 0 went down (scheduler TP0 (pid 4) exited with code 1; no restart left)"
    )


def test_a_node_waits_for_node_0s_engine_start_at_most_its_timeout(
    store_pair: tuple[Any, list[Rendezvous]],
) -> None:
    _, (_, node1) = store_pair  # node 0 never begins a start
    assert PeerWatch(node1).start().await_start("scheduler TP1 (pid 2) exited with code 1", 1) == (
        "node 0 began no engine start within --dist-timeout 1 s"
    )


def test_peer_watch_names_node_0_when_its_store_is_gone() -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = server.port
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
    watch1 = PeerWatch(
        Rendezvous(client, None, 1, 2, RendezvousAddress("127.0.0.1", port, "--dist-init-addr"))
    )
    del server  # node 0's launcher, which hosts the store, is gone
    assert watch1.start().explain("scheduler TP1 (pid 2) exited with code 1") == (
        f"node 0 is gone (its rendezvous at --dist-init-addr 127.0.0.1:{port} no longer answers)"
    )


# ---- start-up checks: before anything starts, or at the rendezvous ----


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--nnodes", "2", "--tp", "3", "--dist-init-addr", "127.0.0.1:5000"],
            {},
            "--tp-size x --pp-size (3 x 1) is not divisible by --nnodes 2",
        ),
        (
            ["--nnodes", "2", "--node-rank", "2", "--tp", "2", "--dist-init-addr", "127.0.0.1:5000"],
            {},
            "--node-rank 2 is outside [0, --nnodes 2)",
        ),
        (
            ["--device", "cuda", "--tp", "64"],
            {},
            "this node runs 64 ranks (--tp-size x --pp-size / --nnodes 1) but has",
        ),
        (
            ["--nnodes", "2", "--tp", "2", "--dist-init-addr", "env://"],
            {"MASTER_ADDR": "", "MASTER_PORT": ""},
            "--dist-init-addr env:// needs MASTER_ADDR and MASTER_PORT in the environment",
        ),
    ],
)
def test_bad_layout_fails_before_anything_starts(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch_server turns these ValueErrors into exit code 2 (tests/test_launcher_server.py)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        plan_launch(parse_server_args(["--port", str(free_port()), *argv]))
    assert message in str(error.value)


@pytest.mark.timeout(90)
def test_duplicate_node_rank_is_refused_at_once(nodes: list[Node], tmp_path: Path, model_dir: Path) -> None:
    dist_port = free_port()
    node0 = fake_node(
        nodes, tmp_path, "node0", ["--model-path", str(model_dir), *two_node_args(dist_port, 0)]
    )
    node1 = fake_node(
        nodes, tmp_path, "node1", ["--model-path", str(model_dir), *two_node_args(dist_port, 1)]
    )
    wait_for_line(node1, "node 1 of 2 met the others")
    again1 = fake_node(
        nodes, tmp_path, "again1", ["--model-path", str(model_dir), *two_node_args(dist_port, 1)]
    )
    again0 = fake_node(
        nodes, tmp_path, "again0", ["--model-path", str(model_dir), *two_node_args(dist_port, 0)]
    )
    assert again1.wait(30) == 1 and again0.wait(30) == 1
    assert (
        f"--node-rank 1 is already taken by the node on host {HOST} (pid {node1.proc.pid})" in again1.output()
    )
    assert (
        f"--node-rank 0 is already taken by the node on host {HOST} (pid {node0.proc.pid})" in again0.output()
    )
    assert "which hosts the rendezvous at --dist-init-addr 127.0.0.1:" in again0.output()
    wait_healthy(node0, http_port(node0))  # the first two went on to serve, undisturbed
    assert node1.proc.poll() is None


@pytest.mark.timeout(90)
def test_nodes_started_differently_both_fail_naming_the_fields(
    nodes: list[Node], tmp_path: Path, model_dir: Path
) -> None:
    other_model = tmp_path / "other"
    other_model.mkdir()
    (other_model / "config.json").write_text('{"num_hidden_layers": 3}')
    dist_port = free_port()
    node0 = fake_node(
        nodes,
        tmp_path,
        "node0",
        ["--model-path", str(model_dir), "--dtype", "float32", *two_node_args(dist_port, 0)],
    )
    node1 = fake_node(
        nodes,
        tmp_path,
        "node1",
        [
            "--model-path",
            str(other_model),
            "--dtype",
            "bfloat16",
            "--page-size",
            "16",
            *two_node_args(dist_port, 1),
        ],
    )
    assert node0.wait(60) == 1 and node1.wait(60) == 1
    for node in (node0, node1):
        out = node.output()
        assert "the nodes were started differently" in out, out[-2000:]
        assert (
            "dtype (node 0: float32, node 1: bfloat16)" in out and "page_size (node 0: 1, node 1: 16)" in out
        )
        assert "model (" in out and f"at {other_model}" in out
        assert "tp_size" not in out  # only what differs
        assert "child processes ready" not in out  # no rank started


@pytest.mark.timeout(60)
def test_a_slow_node_still_hears_why_node_0_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 judges as soon as node 1's fingerprint is in, then exits and takes the store with it:
    it waits (bounded) until node 1 has read the verdict, or node 1 saw only a closed connection."""
    port = free_port()
    node0 = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "from launcher.layout import RendezvousAddress; from launcher.rendezvous import Rendezvous; "
                f"Rendezvous.join(RendezvousAddress('127.0.0.1', {port}, '--dist-init-addr'), 0, 2, "
                "{'dtype': 'float32'}, 20)"
            ),
        ],
        cwd=ROOT,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    real_wait_for = Rendezvous.wait_for
    slowed: list[bool] = []

    def late_first_look(self: Rendezvous, keys: list[str], deadline: float) -> list[str]:
        if not slowed:  # node 1 looks for node 0's fingerprint only after node 0 has judged
            slowed.append(True)
            time.sleep(1.5)
        return real_wait_for(self, keys, deadline)

    monkeypatch.setattr(Rendezvous, "wait_for", late_first_look)
    try:
        with pytest.raises(
            RendezvousError, match=r"started differently.*dtype \(node 0: float32, node 1: bfloat16\)"
        ):
            Rendezvous.join(
                RendezvousAddress("127.0.0.1", port, "--dist-init-addr"), 1, 2, {"dtype": "bfloat16"}, 20
            )
        _, err = node0.communicate(timeout=20)
        assert node0.returncode == 1 and "dtype (node 0: float32, node 1: bfloat16)" in err
    finally:
        node0.kill()


@pytest.mark.timeout(60)
def test_unreachable_dist_init_addr_fails_within_dist_timeout(
    nodes: list[Node], tmp_path: Path, model_dir: Path
) -> None:
    dist_port = free_port()  # nobody listens there
    node1 = fake_node(
        nodes,
        tmp_path,
        "node1",
        ["--model-path", str(model_dir), "--dist-timeout", "3", *two_node_args(dist_port, 1)],
    )
    assert node1.wait(40) == 1
    assert (
        f"cannot reach the rendezvous at --dist-init-addr 127.0.0.1:{dist_port} within --dist-timeout 3 s"
        in node1.output()
    ), node1.output()[-2000:]
    assert time.monotonic() - node1.started < 3 + 25  # interpreter and imports on a busy machine: the rest


@pytest.mark.timeout(60)
def test_node_0_names_the_node_that_never_joined(nodes: list[Node], tmp_path: Path, model_dir: Path) -> None:
    node0 = fake_node(
        nodes,
        tmp_path,
        "node0",
        ["--model-path", str(model_dir), "--dist-timeout", "3", *two_node_args(free_port(), 0)],
    )
    assert node0.wait(40) == 1
    assert "node 1 did not join the rendezvous at --dist-init-addr 127.0.0.1:" in node0.output()
    assert "within --dist-timeout 3 s" in node0.output()


@pytest.mark.timeout(60)
def test_busy_dist_init_port_fails_at_once(nodes: list[Node], tmp_path: Path, model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        dist_port = busy.getsockname()[1]
        node0 = fake_node(
            nodes,
            tmp_path,
            "node0",
            ["--model-path", str(model_dir), "--dist-timeout", "300", *two_node_args(dist_port, 0)],
        )
        assert node0.wait(40) == 1
    assert (
        f"cannot host the rendezvous at --dist-init-addr 127.0.0.1:{dist_port}: port {dist_port} is already "
        f"in use on this host" in node0.output()
    ), node0.output()[-2000:]


# ---- lifetimes, on fake ranks ----


@pytest.mark.timeout(90)
def test_a_dead_rank_on_node_1_takes_both_nodes_down(
    nodes: list[Node], tmp_path: Path, model_dir: Path
) -> None:
    dist_port = free_port()
    node0 = fake_node(
        nodes, tmp_path, "node0", ["--model-path", str(model_dir), *two_node_args(dist_port, 0)]
    )
    node1 = fake_node(
        nodes, tmp_path, "node1", ["--model-path", str(model_dir), *two_node_args(dist_port, 1)], fake="die:1"
    )  # world rank 1 (node 1's only rank) exits 7 a second after it is ready
    assert node1.wait(60) == 1
    assert node0.wait(30) == 1
    dead = f"scheduler TP1 (pid {_pid_in(node1.output(), 'scheduler TP1 (pid ')}) exited with code 7"
    assert f"CRITICAL launcher.supervisor: {dead}; shutting down" in node1.output()
    fail_all = json.loads([ln for ln in node0.output().splitlines() if ln.startswith('{"fail_all"')][0])
    assert fail_all["fail_all"] == f"node 1 went down ({dead})"


@pytest.mark.timeout(90)
def test_a_node_that_fails_to_start_stops_the_others(
    nodes: list[Node], tmp_path: Path, model_dir: Path
) -> None:
    dist_port = free_port()
    node0 = fake_node(
        nodes, tmp_path, "node0", ["--model-path", str(model_dir), *two_node_args(dist_port, 0)]
    )
    node1 = fake_node(
        nodes,
        tmp_path,
        "node1",
        ["--model-path", str(model_dir), *two_node_args(dist_port, 1)],
        fake="raise:1",
    )
    assert node1.wait(60) == 1 and node0.wait(30) == 1
    assert "RuntimeError: fake failure on scheduler TP1" in node1.output()
    assert "node 1 went down (node 1 failed to start: scheduler TP1 (pid" in node0.output(), node0.output()[
        -2000:
    ]


@pytest.mark.timeout(90)
def test_stopping_node_0_stops_node_1_cleanly(nodes: list[Node], tmp_path: Path, model_dir: Path) -> None:
    """SIGTERM to node 0 (a rollout, a scale-down) is not a failure: node 1 follows with exit 0."""
    dist_port = free_port()
    args0 = two_node_args(dist_port, 0)
    node0 = fake_node(nodes, tmp_path, "node0", ["--model-path", str(model_dir), *args0])
    node1 = fake_node(
        nodes, tmp_path, "node1", ["--model-path", str(model_dir), *two_node_args(dist_port, 1)]
    )
    wait_healthy(node0, int(args0[args0.index("--port") + 1]))
    deadline = time.monotonic() + 30
    while "child processes ready" not in node1.output() and time.monotonic() < deadline:
        time.sleep(0.2)
    node0.proc.send_signal(signal.SIGTERM)
    assert node0.wait(30) == 0
    assert node1.wait(30) == 0, node1.output()[-2000:]
    assert "node 0 went down (node 0 received SIGTERM)" in node1.output()


def _pid_in(text: str, prefix: str) -> int:
    start = text.index(prefix) + len(prefix)
    return int(text[start : text.index(")", start)])


# ---- the real server, TP=2 over two nodes ----


def serve_args(model: Path, tokenizer: Path, layout: tuple[str, ...] = ("--tp", "2")) -> list[str]:
    return [
        "--model-path",
        str(model),
        "--tokenizer-path",
        str(tokenizer),
        *layout,
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
    ]


def greedy_prompts() -> list[list[int]]:
    return [list(range(7 + i, 30 + 2 * i)) for i in range(4)]


def greedy_outputs(server: Server) -> list[list[int]]:
    payloads = [
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
        for ids in greedy_prompts()
    ]
    with ThreadPoolExecutor(4) as pool:
        return [r.json()["output_ids"] for r in pool.map(server.generate, payloads)]


def start_two_nodes(
    nodes: list[Node],
    tmp_path: Path,
    model: Path,
    tokenizer: Path,
    env_rendezvous: bool = False,
    layout: tuple[str, ...] = ("--tp", "2"),
    env: dict[str, str] | None = None,
) -> tuple[Server, Node]:
    """Node 1 in the background, then node 0 as a Server (healthy once both nodes serve), both with
    `env`. env_rendezvous: `--dist-init-addr env://` with MASTER_ADDR / MASTER_PORT, as torchrun or
    a LeaderWorkerSet would set them."""
    port = free_port()
    env = {
        **(env or {}),
        **({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if env_rendezvous else {}),
    }
    addr = "env://" if env_rendezvous else f"127.0.0.1:{port}"
    dist = ["--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "120"]
    node1 = Node(
        tmp_path, "node1", [*serve_args(model, tokenizer, layout), *dist, "--node-rank", "1"], env=env
    )
    nodes.append(node1)
    return Server(*serve_args(model, tokenizer, layout), *dist, "--node-rank", "0", env=env), node1


def stream(server: Server) -> tuple[int, list[str]]:
    payload = {
        "input_ids": list(range(5, 25)),
        "stream": True,
        "sampling_params": {"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True},
    }
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=60) as r:
        return r.status_code, [ln for ln in r.iter_lines(decode_unicode=True) if ln]


def assert_gone(procs: list[psutil.Process], timeout: float = 10) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, [p.pid for p in alive]


@pytest.mark.slow  # the default run: killing node 0 (PP over two real nodes) and a dead rank on node 1
@pytest.mark.timeout(400)
def test_two_nodes_serve_what_one_node_serves_and_go_down_with_node_1(
    nodes: list[Node], tmp_path: Path, long_context_llama: Path, smollm2_dir: Path
) -> None:
    with Server(*serve_args(long_context_llama, smollm2_dir)) as single:
        expected = greedy_outputs(single)
    server, node1 = start_two_nodes(nodes, tmp_path, long_context_llama, smollm2_dir)
    with server:
        assert greedy_outputs(server) == expected
        node0_tree = server.children()
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream, server) for _ in range(2)]
            time.sleep(1.5)  # both streams are mid-generation
            os.kill(node1.proc.pid, signal.SIGKILL)
            for f in streams:
                status, lines = f.result(timeout=30)
                assert status == 200 and lines[-1] == "data: [DONE]"
                errors = [json.loads(ln[6:])["error"]["message"] for ln in lines[:-1] if '"error"' in ln]
                assert errors and "node 1 is gone" in errors[0], lines[-3:]
        assert server.proc.wait(timeout=30) != 0
        assert f"exited with code 1: node 1 is gone (no heartbeat for {LOST_AFTER_S:g} s)" in server.output()
        assert_gone(node0_tree)


@pytest.mark.timeout(300)
def test_killing_node_0_makes_node_1_exit(
    nodes: list[Node], tmp_path: Path, long_context_llama: Path, smollm2_dir: Path
) -> None:
    """Two pipeline stages, one per node, meeting through the environment's rendezvous."""
    hf = hf_float32(long_context_llama)
    expected = [hf_greedy(hf, ids, 16) for ids in greedy_prompts()]
    server, node1 = start_two_nodes(
        nodes, tmp_path, long_context_llama, smollm2_dir, env_rendezvous=True, layout=("--pp", "2")
    )
    with server:
        assert greedy_outputs(server) == expected
        node1_tree = node1.tree()
        titles = [" ".join(p.cmdline()).strip() for p in node1_tree[1:]]
        assert "srt::scheduler_PP1_TP0" in titles and "srt::detokenizer" not in titles  # its stage only
        os.kill(server.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        assert node1.wait(30) == 1
        assert time.monotonic() - start < 20
        assert "node 0 is gone (its rendezvous at MASTER_ADDR:MASTER_PORT 127.0.0.1:" in node1.output()
        assert_gone(node1_tree)


@pytest.mark.timeout(300)
def test_node_0_metrics_show_the_ranks_of_every_node(
    nodes: list[Node], tmp_path: Path, long_context_llama: Path, smollm2_dir: Path
) -> None:
    """TP=2 over two nodes with --enable-metrics: rank 1 runs on node 1, and node 0's /metrics
    has its series (relayed through the rendezvous store), stepping with rank 0's."""
    from prometheus_client.parser import text_string_to_metric_families

    server, _ = start_two_nodes(
        nodes, tmp_path, long_context_llama, smollm2_dir, layout=("--tp", "2", "--enable-metrics")
    )
    with server:
        assert greedy_outputs(server)

        def steps() -> dict[str, float]:
            text = requests.get(server.url + "/metrics", timeout=10).text
            return {
                s.labels["rank"]: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "srt:forward_steps_total"
            }

        deadline = time.monotonic() + 20
        while (found := steps()).get("1", 0) != found.get("0", -1) or not found.get("0"):
            assert time.monotonic() < deadline, found  # the relay publishes every second
            time.sleep(0.3)
        assert set(found) == {"0", "1"} and found["0"] > 0


# ---- --restart-on-failure over two nodes ----


def node_rank_pid(node: Node, title: str) -> int:
    for p in node.tree()[1:]:
        if " ".join(p.cmdline()).strip() == title:
            return p.pid
    raise AssertionError(f"no process titled {title} on {node.log_path.stem}")


@pytest.mark.slow  # ~50 s; the restart of one node's engine is covered in the default run by test_restart
@pytest.mark.timeout(400)
def test_a_rank_killed_on_node_1_restarts_every_node_and_every_stream_continues(
    nodes: list[Node], tmp_path: Path, long_context_llama: Path, smollm2_dir: Path
) -> None:
    """TP=2 over two nodes (one rank each) with --restart-on-failure: node 1's rank is SIGKILLed
    mid-stream in four streams (greedy and seeded); both nodes restart their ranks as engine start
    1, node 0 replays, and every stream ends with the tokens and text of a fault-free run."""
    from test_restart import MAX_NEW_TOKENS, payloads, streams_through_a_kill

    layout = ("--tp", "2", "--restart-on-failure", "1")
    server, node1 = start_two_nodes(nodes, tmp_path, long_context_llama, smollm2_dir, layout=layout)
    bodies = payloads()[:4]
    with server:
        with ThreadPoolExecutor(len(bodies)) as pool:  # the fault-free run
            expected = [r.json() for r in pool.map(lambda b: server.generate(b, timeout=300), bodies)]
        assert all(len(e["output_ids"]) == MAX_NEW_TOKENS for e in expected), expected
        assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200

        results = streams_through_a_kill(server, bodies, lambda: node_rank_pid(node1, "srt::scheduler_TP1"))
        out0, out1 = server.output(), node1.output()
        for (ids, text, _, meta), want in zip(results, expected):
            assert ids == want["output_ids"] and text == want["text"], out0[-3000:] + out1[-3000:]
            assert meta["completion_tokens"] == MAX_NEW_TOKENS
        assert "killed by signal SIGKILL; waiting for node 0 to restart the engine" in out1, out1[-3000:]
        assert "node 0 began engine start 1; restarting this node's ranks" in out1
        assert "restarting the engine (restart 1 of at most 1" in out0, out0[-3000:]
        assert "engine restarted in" in out0 and "engine restarted in" in out1
        assert server.proc.poll() is None and node1.proc.poll() is None
        assert server.generate(bodies[0], timeout=300).json()["output_ids"] == expected[0]["output_ids"]


@pytest.mark.slow  # ~22 s; a lost node taking node 0 down stays in the default run
@pytest.mark.timeout(400)
def test_a_crash_loop_on_node_1_takes_every_node_down_after_node_0s_restarts(
    nodes: list[Node], tmp_path: Path, long_context_llama: Path, smollm2_dir: Path
) -> None:
    """Node 1's rank crashes at every engine start: node 0 restarts once (its budget), then both
    nodes exit 1, the client's stream ends with an error, and node 1's log names node 0's decision."""
    from test_restart import payloads

    server, node1 = start_two_nodes(
        nodes,
        tmp_path,
        long_context_llama,
        smollm2_dir,
        layout=("--tp", "2", "--restart-on-failure", "1"),
        env={"SRT_TEST_FAULT": "crash@1:3"},  # world rank 1, on node 1, at step 3 of every start
    )
    with server:
        node0_tree, node1_tree = server.children(), node1.tree()
        with requests.post(
            server.url + "/generate", json={**payloads()[0], "stream": True}, stream=True, timeout=300
        ) as r:
            lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
        assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:]), lines[-3:]
        assert server.proc.wait(timeout=60) == 1 and node1.wait(60) == 1
        out0, out1 = server.output(), node1.output()
        assert out0.count("restarting the engine (restart") == 1, out0[-3000:]
        assert "no restart left (1 within the last 300 s, --restart-on-failure 1)" in out0
        assert "node 0 went down first (" in out1 and "no restart left" in out1, out1[-3000:]
        assert_gone(node0_tree + node1_tree)


@pytest.mark.timeout(300)
def test_a_lost_node_takes_node_0_down_even_with_restarts_left(
    nodes: list[Node], tmp_path: Path, long_context_llama: Path, smollm2_dir: Path
) -> None:
    """Node 1's launcher SIGKILLed (the node is gone, not just a rank): its ranks cannot come back,
    so node 0 stops restarting as soon as node 1's heartbeat stops, instead of waiting --dist-timeout
    (120 s here) for them, and goes down naming node 1."""
    layout = ("--tp", "2", "--restart-on-failure", "2")
    server, node1 = start_two_nodes(nodes, tmp_path, long_context_llama, smollm2_dir, layout=layout)
    with server:
        node0_tree = server.children()
        os.kill(node1.proc.pid, signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1
        out = server.output()
        assert f"no restart: node 1 is gone (no heartbeat for {LOST_AFTER_S:g} s)" in out, out[-3000:]
        assert "DistStoreError" not in out  # no start waited for node 1's ranks until it timed out
        assert_gone(node0_tree)
