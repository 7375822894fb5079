"""SGLang's router binary (sglang-router, the test extra) in front of srt servers, started and
always torn down by a test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import requests

from srt.server_process import kill_all
from srt.utils import free_port


class Router:
    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "cache_aware",
        startup_timeout: float = 90.0,
        api_key: str | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log_path = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"sglang-router-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-urls",
                *worker_urls,
                "--policy",
                policy,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--health-check-interval-secs",
                "1",
                "--health-failure-threshold",
                "1",
                "--log-level",
                "warn",
                *(["--api-key", api_key] if api_key else []),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}:\n{self.output()}")
            if len(self.healthy_workers()) == len(worker_urls):
                return
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"sglang-router did not see {len(worker_urls)} healthy workers:\n{self.output()}")

    def healthy_workers(self) -> list[str]:
        try:
            workers = requests.get(self.url + "/workers", headers=self.headers, timeout=5).json()["workers"]
        except (requests.RequestException, ValueError, KeyError):
            return []
        return sorted(w["url"] for w in workers if w.get("is_healthy"))

    def loads(self) -> dict[str, int]:
        body = requests.get(self.url + "/get_loads", timeout=10).json()
        return {w["worker"]: int(w["load"]) for w in body["workers"]}

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        try:
            procs = [psutil.Process(self.proc.pid)]
        except psutil.NoSuchProcess:
            procs = []
        kill_all(procs)
        self.proc.wait(timeout=10)
        self.log.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
