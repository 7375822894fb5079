"""launch_server as a real process tree, with fake scheduler/detokenizer targets and a fake front end
(tests/launcher_targets.py), so it runs before and without the real model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from launcher.teardown import kill_process_tree
from srt.utils import LOWEST_DRAWN_PORT, ephemeral_ports, free_port

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Node:
    """`python tests/launcher_targets.py node ARGS...`: launch_server.run with fake targets."""

    def __init__(
        self,
        tmp_path: Path,
        args: list[str],
        fake: str = "",
        die_after: float = 1.0,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        env = {
            **ENV,
            **(extra_env or {}),
            "SRT_TEST_FAKE": fake,
            "SRT_TEST_PID_DIR": str(self.pid_dir),
            "SRT_TEST_DIE_AFTER": str(die_after),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "launcher_targets.py"), "node", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def child_pids(self) -> dict[str, int]:
        return {p.name: int(p.read_text()) for p in self.pid_dir.iterdir() if p.read_text()}

    def finish(self, timeout: float) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            kill_process_tree(self.proc.pid)
        return self.proc.returncode, out, err


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_healthy(node: Node, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert node.proc.poll() is None, node.finish(5)
        try:
            if http_get(port, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def test_bad_flag_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--tp-size", "0"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS.parent,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "launch_server: error: --tp-size must be positive, got 0"


@pytest.mark.skipif(
    ephemeral_ports()[0] <= LOWEST_DRAWN_PORT + 1000, reason="no room below the ephemeral range"
)
def test_free_ports_are_drawn_below_the_ephemeral_range() -> None:
    """A port chosen now and bound later (a test server's --port, a replica's, the rendezvous) is one
    no outbound connection can take in between: below the range the kernel gives those from."""
    low = ephemeral_ports()[0]
    ports = [free_port() for _ in range(20)]
    assert all(LOWEST_DRAWN_PORT <= port < low for port in ports) and len(set(ports)) > 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))  # free when drawn


def test_busy_port_fails_at_once_naming_it() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "srt.launch_server", "--port", str(port)],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=TESTS.parent,
        )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0-1|x", "launch_server: error: SGLANG_CPU_OMP_THREADS_BIND='0-1|x': cannot read 'x' as a CPU"),
        ("0", "launch_server: error: SGLANG_CPU_OMP_THREADS_BIND='0' has 1 CPU range(s) for the 2 rank(s)"),
    ],
)
def test_a_bad_cpu_binding_is_a_start_up_error_naming_the_variable(value: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--tp-size", "2", "--port", str(free_port())],
        env={**ENV, "SGLANG_CPU_OMP_THREADS_BIND": value},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS.parent,
    )
    assert result.returncode == 2 and result.stderr.startswith(message), result.stderr


def test_each_rank_takes_cpu_threads_and_its_cpu_binding(tmp_path: Path, model_dir: Path) -> None:
    """--cpu-threads sets every rank's torch threads; SGLANG_CPU_OMP_THREADS_BIND pins each rank to
    its range (here both on the first CPU this process may use)."""
    cpu = min(os.sched_getaffinity(0))
    port = free_port()
    node = Node(
        tmp_path,
        ["--model-path", str(model_dir), "--tp-size", "2", "--port", str(port), "--cpu-threads", "3"],
        extra_env={"SGLANG_CPU_OMP_THREADS_BIND": f"{cpu}|{cpu}"},
    )
    wait_healthy(node, port)
    pids = node.child_pids()
    for title in ("srt::scheduler_TP0", "srt::scheduler_TP1"):
        assert psutil.Process(pids[title]).cpu_affinity() == [cpu]
    node.proc.send_signal(signal.SIGTERM)
    code, _, err = node.finish(timeout=20)
    assert code == 0, err
    for rank in (0, 1):
        assert f"scheduler TP{rank}: 3 torch threads, pinned to CPUs [{cpu}]" in err, err


def test_start_up_failure_names_the_rank(tmp_path: Path, model_dir: Path) -> None:
    node = Node(
        tmp_path,
        ["--model-path", str(model_dir), "--tp-size", "2", "--port", str(free_port())],
        fake="raise:1",
    )
    code, _, err = node.finish(timeout=90)
    assert code == 1
    assert "launch failed: scheduler TP1 (pid" in err and "RuntimeError: fake failure on scheduler TP1" in err
    assert "Traceback" in err
    assert all(gone(pid) for pid in node.child_pids().values())


def test_serves_then_stops_on_sigterm(tmp_path: Path, model_dir: Path) -> None:
    port = free_port()
    node = Node(tmp_path, ["--model-path", str(model_dir), "--tp-size", "2", "--port", str(port)])
    wait_healthy(node, port)
    info = json.loads(http_get(port, "/server_info")[1])
    assert info["context_length"] == 2048 and info["model_dir"] == str(model_dir)
    assert info["http_port_bindable"] is False  # held from before the children started: none can take it
    pids = node.child_pids()
    assert set(pids) == {"srt::scheduler_TP0", "srt::scheduler_TP1", "srt::detokenizer"}
    node.proc.send_signal(signal.SIGTERM)
    code, _, err = node.finish(timeout=20)
    assert code == 0, err
    assert all(gone(pid) for pid in pids.values())


def test_rank_death_fails_requests_and_exits(tmp_path: Path, model_dir: Path) -> None:
    port = free_port()
    node = Node(
        tmp_path,
        ["--model-path", str(model_dir), "--tp-size", "2", "--port", str(port)],
        fake="die:1",
        die_after=8,
    )
    wait_healthy(node, port)
    pids = node.child_pids()
    code, out, err = node.finish(timeout=30)
    assert code == 1
    message = f"scheduler TP1 (pid {pids['srt::scheduler_TP1']}) exited with code 7"
    assert json.loads(out.strip().splitlines()[-1]) == {"fail_all": message, "on_loop": True}
    assert f"CRITICAL launcher.supervisor: {message}" in err
    assert all(gone(pid) for pid in pids.values())
