"""Start the real `launch_server` process tree for a test (srt/server_process.py), and always tear
it down: SIGKILL at once (a test does not wait for the graceful drain), the log kept in PYTEST_TMPDIR."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import requests

from srt.server_process import ServerProcess


class Server(ServerProcess):
    def __init__(self, *args: str, startup_timeout: float = 180.0, env: dict[str, str] | None = None) -> None:
        super().__init__(
            args,
            startup_timeout,
            env=env,
            log_dir=Path(os.environ.get("PYTEST_TMPDIR", "/tmp")),
            stop_timeout_s=0,
        )

    def generate(self, payload: dict[str, Any], timeout: float = 120.0) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)

    def internal_state(self) -> dict[str, Any]:
        info = requests.get(self.url + "/server_info", timeout=30).json()
        return info["internal_states"][0]  # type: ignore[no-any-return]

    def __enter__(self) -> Server:
        return self
