"""An srt server as a child process tree, for tests and benchmarks: `python -m srt.launch_server` on
a free loopback port, healthy when the constructor returns, always ended by `close`."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import psutil

from srt.utils import free_port

ROOT = (
    Path(__file__).resolve().parent.parent
)  # the checkout: the child imports this srt, not an installed one


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL every process (already gone is fine) and reap them."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError):  # a 503 while starting is a URLError
        return False


def _rendezvous_port(args: Sequence[str], env: dict[str, str]) -> int | None:
    """The port `--dist-init-addr HOST:PORT` (or, with `env://`, MASTER_PORT) names: node 0 binds it
    beside its --port, so the two must differ."""
    addr = next((b for a, b in zip(args, args[1:]) if a == "--dist-init-addr"), None)
    port = env.get("MASTER_PORT") if addr == "env://" else (addr or "").rpartition(":")[2]
    return int(port) if port and port.isdigit() else None


class ServerProcess:
    """`ServerProcess(args)`: the server with `args` after `--port`. `env` adds to this process's
    environment. The log goes to `log_dir` (kept) or to a temporary file removed by `close`.
    `close` sends SIGTERM and waits `stop_timeout_s` for the graceful drain before SIGKILL; with 0 it
    SIGKILLs the tree at once."""

    def __init__(
        self,
        args: Sequence[str],
        startup_timeout_s: float = 180.0,
        *,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        stop_timeout_s: float = 15.0,
    ) -> None:
        self.port = free_port(avoid=_rendezvous_port(args, env or {}))
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop_timeout_s = stop_timeout_s
        self.keep_log = log_dir is not None
        self.log: IO[bytes]
        if log_dir is not None:
            self.log_path = log_dir / f"srt-server-{self.port}.log"
            self.log = open(self.log_path, "wb")  # noqa: SIM115
        else:
            self.log = tempfile.NamedTemporaryFile(
                prefix=f"srt-server-{self.port}-",
                suffix=".log",  # noqa: SIM115
                delete=False,
            )
            self.log_path = Path(self.log.name)
        python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "srt.launch_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *args,
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": python_path, **(env or {})},
        )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if _healthy(self.url):
                return
            time.sleep(0.3)
        raise RuntimeError(f"server not healthy within {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        """Everything the server wrote so far (stdout and stderr)."""
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        procs = self.children()
        if self.proc.poll() is None:
            procs.append(psutil.Process(self.proc.pid))
            if self.stop_timeout_s > 0:
                self.proc.send_signal(signal.SIGTERM)
                _, procs = psutil.wait_procs(procs, timeout=self.stop_timeout_s)
        kill_all(procs)
        self.proc.wait(timeout=10)
        self.log.close()
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
