"""An srt server as a child process tree for a benchmark: `python -m srt.launch_server` on a free
loopback port, healthy when the constructor returns, always ended by `close` (SIGTERM, then SIGKILL
for what is left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from bench_clients import HTTP_ERRORS, http_call

from srt.utils import free_port

ROOT = Path(__file__).resolve().parent.parent
SHOWN_LOG_CHARS = 3000


class SrtServer:
    def __init__(self, args: list[str], startup_timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"srt-bench-{self.port}-", suffix=".log",  # noqa: SIM115
                                               delete=False)
        command = [sys.executable, "-m", "srt.launch_server", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output_tail()}")
            try:
                if http_call(f"{self.url}/health", timeout_s=2).status == 200:
                    return
            except HTTP_ERRORS:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server was not healthy within {timeout_s} s:\n{self.output_tail()}")

    def output_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-SHOWN_LOG_CHARS:]

    def close(self) -> None:
        """SIGTERM (nothing is in flight, so the graceful drain is quick), then SIGKILL what is left."""
        try:
            procs = [*psutil.Process(self.proc.pid).children(recursive=True), psutil.Process(self.proc.pid)]
        except psutil.NoSuchProcess:
            procs = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        self.proc.wait(timeout=10)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> SrtServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
