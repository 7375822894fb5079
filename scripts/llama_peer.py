"""llama.cpp's OpenAI-compatible server as a peer of the benchmarks (bench_colocated.py,
compare_peers.py, bench_speculative.py).

The server is `llama-server` when it is on PATH (build it from llama.cpp's source: `cmake -B build
-DLLAMA_CURL=OFF && cmake --build build --target llama-server`), else llama-cpp-python's (`python -m
llama_cpp.server`, which answers one request at a time); a command line of your own replaces both.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from srt.utils import free_port  # noqa: E402

INSTALL_HINT = (
    "no llama.cpp server: no llama-server on PATH and {python} lacks llama_cpp.server "
    "(pip install 'llama-cpp-python[server]'), or pass --llama-server CMD"
)


def llama_command(explicit: str | None, python: str | None = None) -> list[str]:
    """`explicit` split as a shell would, else llama-server from PATH, else llama-cpp-python's server in
    `python` (default: this interpreter). Raises RuntimeError when there is none."""
    if explicit:
        return shlex.split(explicit)
    binary = shutil.which("llama-server")
    if binary:
        return [binary]
    python = python or sys.executable
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp.server') is None)"
    if subprocess.run([python, "-c", probe]).returncode != 0:
        raise RuntimeError(INSTALL_HINT.format(python=python))
    return [python, "-m", "llama_cpp.server"]


def is_llama_server(command: list[str]) -> bool:
    return Path(command[0]).name == "llama-server"


class LlamaServer:
    """llama.cpp's server as a child process, healthy when the constructor returns.

    `parallel` slots share a context of `context` tokens per slot (llama-server's -np, continuous
    batching); `extra` flags go last (e.g. `--spec-type ngram-simple`). llama-cpp-python's server has
    one slot and takes neither."""

    def __init__(
        self,
        command: list[str],
        gguf: str,
        threads: int,
        context: int = 2048,
        parallel: int = 1,
        extra: list[str] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: IO[bytes] = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
        host = ["--host", "127.0.0.1", "--port", str(self.port)]
        if is_llama_server(command):
            args = [
                "-m",
                gguf,
                *host,
                "-t",
                str(threads),
                "-c",
                str(context * parallel),
                "-np",
                str(parallel),
            ]
        else:
            if parallel > 1 or extra:
                raise ValueError("llama-cpp-python's server has one slot and no speculation flags here")
            args = ["--model", gguf, *host, "--n_threads", str(threads), "--n_ctx", str(context)]
            args += ["--verbose", "false"]
        self.proc = subprocess.Popen(
            command + args + (extra or []), stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama.cpp server not up within {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
