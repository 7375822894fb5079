"""Start the real `launch_server` process tree for a test, and always tear it down."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import requests

from srt.utils import free_port

ROOT = Path(__file__).resolve().parent.parent


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL every process (already gone is fine) and reap them."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class Server:
    def __init__(self, *args: str, startup_timeout: float = 180.0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"srt-server-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "srt.launch_server", "--port", str(self.port), *args],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"server not healthy within {startup_timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def generate(self, payload: dict[str, Any], timeout: float = 120.0) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)

    def internal_state(self) -> dict[str, Any]:
        info = requests.get(self.url + "/server_info", timeout=30).json()
        return info["internal_states"][0]  # type: ignore[no-any-return]

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        procs = self.children()
        for p in [psutil.Process(self.proc.pid)] if self.proc.poll() is None else []:
            procs.append(p)
        kill_all(procs)
        self.proc.wait(timeout=10)
        self.log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
