"""Spawning, the start-up handshake, supervision and parent death, with tiny fake targets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launcher.child import ChildSpec
from launcher.process import ChildProcess, LaunchError, spawn_child, stop_children, wait_ready
from launcher.supervisor import TERM_GRACE_S, Supervisor
from launcher.teardown import kill_process_tree

pytestmark = pytest.mark.timeout(60)

TESTS = Path(__file__).resolve().parent


def spec(
    name: str, target: str, *args: object, threads: int | None = None, parent_death_signal: bool = True
) -> ChildSpec:
    title = "srt::" + name.replace("scheduler ", "scheduler_").replace(" ", "_")
    return ChildSpec(
        name=name,
        title=title,
        target=f"launcher_targets:{target}",
        args=args,
        num_threads=threads,
        parent_death_signal=parent_death_signal,
    )


@pytest.fixture
def spawned() -> Iterator[list[ChildProcess]]:
    children: list[ChildProcess] = []
    yield children
    stop_children(children)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate: object, timeout: float) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def test_ready_info_title_and_threads(spawned: list[ChildProcess]) -> None:
    spawned += [
        spawn_child(spec(f"scheduler TP{i}", "ready_then_sleep", {"rank": i}, threads=1)) for i in range(2)
    ]
    infos = wait_ready(spawned, timeout=30)
    assert infos["scheduler TP1"]["rank"] == 1 and infos["scheduler TP1"]["pid"] == spawned[1].pid
    assert infos["scheduler TP0"]["threads"] == 1
    cmdline = " ".join(psutil.Process(spawned[1].pid).cmdline())
    assert "srt::scheduler_TP1" in cmdline


def test_error_at_start_names_the_child_fast(
    spawned: list[ChildProcess], caplog: pytest.LogCaptureFixture
) -> None:
    spawned += [
        spawn_child(spec("scheduler TP0", "ready_then_sleep", {})),
        spawn_child(spec("scheduler TP1", "raise_at_start")),
    ]
    start = time.monotonic()
    with pytest.raises(
        LaunchError,
        match=r"scheduler TP1 \(pid \d+\) failed during start-up: "
        r"RuntimeError: weights are missing",
    ):
        wait_ready(spawned, timeout=30)
    assert time.monotonic() - start < 15
    assert "Traceback" in caplog.text and "raise_at_start" in caplog.text  # the child's traceback is logged


def test_exit_at_start_reports_the_code(spawned: list[ChildProcess]) -> None:
    spawned += [
        spawn_child(spec("scheduler TP0", "ready_then_sleep", {})),
        spawn_child(spec("scheduler TP1", "exit_at_start", 3)),
    ]
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^scheduler TP1 \(pid \d+\) exited with code 3 during start-up$"):
        wait_ready(spawned, timeout=30)
    assert time.monotonic() - start < 15


def test_killed_at_start_reports_the_signal(spawned: list[ChildProcess]) -> None:
    spawned += [
        spawn_child(spec("scheduler TP0", "never_ready")),
        spawn_child(spec("detokenizer", "ready_then_sleep", {})),
    ]
    wait_ready(spawned[1:], timeout=30)
    threading.Timer(0.5, os.kill, (spawned[0].pid, signal.SIGKILL)).start()
    with pytest.raises(
        LaunchError, match=r"scheduler TP0 \(pid \d+\) was killed by signal SIGKILL during start-up"
    ):
        wait_ready(spawned, timeout=30)


def test_start_timeout_names_the_stragglers(spawned: list[ChildProcess]) -> None:
    spawned += [
        spawn_child(spec("scheduler TP0", "ready_then_sleep", {})),
        spawn_child(spec("scheduler TP1", "never_ready")),
    ]
    with pytest.raises(LaunchError, match=r"^scheduler TP1 \(pid \d+\) not ready within 8 s$"):
        wait_ready(spawned, timeout=8)


class Recorder:
    def __init__(self) -> None:
        self.failures: list[tuple[float, str]] = []
        self.exits: list[int] = []

    def on_failure(self, message: str) -> None:
        self.failures.append((time.monotonic(), message))

    def exit(self, code: int) -> None:
        self.exits.append(code)


def test_supervisor_names_a_killed_child_and_takes_down_the_rest(
    spawned: list[ChildProcess], caplog: pytest.LogCaptureFixture
) -> None:
    spawned += [spawn_child(spec(f"scheduler TP{i}", "ready_then_sleep", {})) for i in range(3)]
    wait_ready(spawned, timeout=30)
    rec = Recorder()
    supervisor = Supervisor(spawned, rec.on_failure, grace_s=0.2, exit_fn=rec.exit)
    supervisor.start()
    killed_at = time.monotonic()
    os.kill(spawned[1].pid, signal.SIGKILL)
    assert supervisor.done.wait(10)
    ((failed_at, message),) = rec.failures
    assert failed_at - killed_at < 2.0
    assert message == f"scheduler TP1 (pid {spawned[1].pid}) was killed by signal SIGKILL"
    assert rec.exits == [1]
    assert all(gone(c.pid) for c in spawned)
    assert any(r.levelname == "CRITICAL" and "scheduler TP1" in r.getMessage() for r in caplog.records)


def test_supervisor_reports_exit_code_and_traceback(
    spawned: list[ChildProcess], caplog: pytest.LogCaptureFixture
) -> None:
    spawned += [
        spawn_child(spec("scheduler TP0", "ready_then_sleep", {})),
        spawn_child(spec("scheduler TP1", "ready_then_raise")),
    ]
    wait_ready(spawned, timeout=30)
    rec = Recorder()
    supervisor = Supervisor(spawned, rec.on_failure, grace_s=0.0, exit_fn=rec.exit)
    supervisor.start()
    assert supervisor.done.wait(15)
    assert rec.failures[0][1] == f"scheduler TP1 (pid {spawned[1].pid}) exited with code 1"
    assert "scheduler loop crashed" in caplog.text
    assert gone(spawned[0].pid)


def test_supervisor_stop_is_quiet(spawned: list[ChildProcess]) -> None:
    spawned += [spawn_child(spec("scheduler TP0", "ready_then_sleep", {}))]
    wait_ready(spawned, timeout=30)
    rec = Recorder()
    supervisor = Supervisor(spawned, rec.on_failure, exit_fn=rec.exit)
    supervisor.start()
    supervisor.stop()
    stop_children(spawned)
    time.sleep(0.5)
    assert rec.failures == [] and rec.exits == [] and not supervisor.done.is_set()


def test_a_sigterm_the_server_shuts_down_on_is_quiet(
    spawned: list[ChildProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGTERM to the whole process group reaches a child before the main process calls stop():
    no failure and no CRITICAL line when stop() follows within TERM_GRACE_S."""
    spawned += [spawn_child(spec("detokenizer", "ready_then_sleep", {}))]
    wait_ready(spawned, timeout=30)
    rec = Recorder()
    supervisor = Supervisor(spawned, rec.on_failure, grace_s=0.0, exit_fn=rec.exit)
    supervisor.start()
    os.kill(spawned[0].pid, signal.SIGTERM)
    time.sleep(0.5)
    supervisor.stop()
    time.sleep(0.5)
    assert rec.failures == [] and rec.exits == [] and not supervisor.done.is_set()
    assert not any(r.levelname == "CRITICAL" for r in caplog.records)


def test_a_sigterm_with_no_shutdown_is_still_a_failure(spawned: list[ChildProcess]) -> None:
    """A child killed by SIGTERM while the server goes on is a lost child: reported once
    TERM_GRACE_S passes without stop()."""
    spawned += [spawn_child(spec("detokenizer", "ready_then_sleep", {}))]
    wait_ready(spawned, timeout=30)
    rec = Recorder()
    supervisor = Supervisor(spawned, rec.on_failure, grace_s=0.0, exit_fn=rec.exit)
    supervisor.start()
    killed_at = time.monotonic()
    os.kill(spawned[0].pid, signal.SIGTERM)
    assert supervisor.done.wait(TERM_GRACE_S + 10)
    ((failed_at, message),) = rec.failures
    assert failed_at - killed_at >= TERM_GRACE_S
    assert message == f"detokenizer (pid {spawned[0].pid}) was killed by signal SIGTERM" and rec.exits == [1]


@pytest.mark.parametrize("parent_death_signal", ["1", "0"], ids=["pdeathsig", "watcher-thread"])
def test_children_die_with_their_parent(parent_death_signal: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    parent = subprocess.Popen(
        [sys.executable, str(TESTS / "launcher_targets.py"), "parent", parent_death_signal],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert parent.stdout is not None
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        parent.kill()
        parent.wait(5)
        assert wait_until(lambda: all(gone(p) for p in pids), 10), "children outlived their parent"
    finally:
        kill_process_tree(parent.pid)
        parent.wait(5)
