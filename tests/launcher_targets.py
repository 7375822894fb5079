"""Tiny child targets for the launcher tests (imported by name inside spawned children)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def ready_then_sleep(info: dict[str, Any], ready_conn: Connection) -> None:
    ready_conn.send(("ready", {**info, "pid": os.getpid(), "threads": _torch_threads()}))
    time.sleep(600)


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def raise_at_start(ready_conn: Connection) -> None:
    raise RuntimeError("weights are missing: model.layers.3.mlp")


def exit_at_start(code: int, ready_conn: Connection) -> None:
    time.sleep(0.2)
    os._exit(code)


def never_ready(ready_conn: Connection) -> None:
    time.sleep(600)


def ready_then_raise(ready_conn: Connection) -> None:
    ready_conn.send(("ready", {}))
    time.sleep(0.5)
    raise RuntimeError("scheduler loop crashed")


# ---- fake server targets (same signatures as the real scheduler / detokenizer) ----

FAKE_MODEL_INFO = {
    "context_length": 2048,
    "vocab_size": 1000,
    "max_total_tokens": 4096,
    "eos_token_ids": [2],
    "max_running_requests": 8,
}


def fake_scheduler(
    server_args: Any, port_args: Any, model_dir: str, rank_info: Any, ready_conn: Connection
) -> None:
    """Behaviour from SRT_TEST_FAKE: "raise:<world rank>" fails that rank at start-up;
    "die:<world rank>" makes it exit 7 a moment after it is ready. Writes its pid to
    $SRT_TEST_PID_DIR/<title> so a test can check it is gone."""
    _record_pid(rank_info.title)
    mode, _, rank_text = os.environ.get("SRT_TEST_FAKE", "").partition(":")
    mine = rank_text == str(rank_info.world_rank)
    if mode == "raise" and mine:
        raise RuntimeError(f"fake failure on {rank_info.name}")
    info = dict(FAKE_MODEL_INFO) if rank_info.is_input_rank or rank_info.is_output_rank else {}
    info["http_port_bindable"] = _bindable(server_args.port)
    ready_conn.send(("ready", {**info, "world_rank": rank_info.world_rank}))
    if mode == "die" and mine:
        time.sleep(float(os.environ.get("SRT_TEST_DIE_AFTER", "1")))
        os._exit(7)
    time.sleep(600)


def _bindable(port: int) -> bool:
    """Whether this process could take the server's HTTP port (as a child's own socket might)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _record_pid(title: str) -> None:
    pid_dir = os.environ.get("SRT_TEST_PID_DIR")
    if pid_dir:
        (Path(pid_dir) / title).write_text(str(os.getpid()))


def fake_detokenizer(server_args: Any, port_args: Any, tokenizer_path: str, ready_conn: Connection) -> None:
    _record_pid("srt::detokenizer")
    ready_conn.send(("ready", {}))
    time.sleep(600)


def spawning_parent(parent_death_signal: str) -> None:
    """Helper parent (run as a script): spawns two sleeping children, prints their pids, sleeps.
    The test SIGKILLs it and checks that the children follow."""
    from launcher.child import ChildSpec
    from launcher.process import spawn_child, wait_ready

    children = [
        spawn_child(
            ChildSpec(
                name=f"scheduler TP{i}",
                title=f"srt::scheduler_TP{i}",
                target="launcher_targets:ready_then_sleep",
                args=({},),
                parent_death_signal=parent_death_signal == "1",
            )
        )
        for i in range(2)
    ]
    wait_ready(children, timeout=60)
    print(json.dumps([c.pid for c in children]), flush=True)
    time.sleep(600)


def install_fake_frontend() -> None:
    """Stand-ins for srt.tokenizer_manager / srt.http_server with the interface launch_server uses:
    TokenizerManager(server_args, port_args, tokenizer_path, model_info) with `loop` and
    `fail_all(message)`, create_app(tm, server_info), run_http_server(app, listener, log_level)."""
    import asyncio
    import types
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    class TokenizerManager:
        def __init__(self, server_args: Any, port_args: Any, tokenizer_path: str, model_info: dict) -> None:
            self.loop: asyncio.AbstractEventLoop | None = None
            self.failed: str | None = None

        def fail_all(self, message: str) -> None:
            on_loop = asyncio.get_running_loop() is self.loop
            print(json.dumps({"fail_all": message, "on_loop": on_loop}), flush=True)
            self.failed = message

    def create_app(tm: TokenizerManager, server_info: dict) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            tm.loop = asyncio.get_running_loop()
            yield

        app = FastAPI(lifespan=lifespan)

        @app.get("/health")
        def health() -> JSONResponse:
            return JSONResponse({"error": tm.failed}, status_code=503 if tm.failed else 200)

        @app.get("/server_info")
        def info() -> dict:
            return server_info

        return app

    def run_http_server(app: FastAPI, listener: socket.socket, log_level: str) -> None:
        uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[listener])

    sys.modules["srt.tokenizer_manager"] = types.SimpleNamespace(TokenizerManager=TokenizerManager)  # type: ignore
    sys.modules["srt.http_server"] = types.SimpleNamespace(
        create_app=create_app,  # type: ignore
        run_http_server=run_http_server,
    )


def fake_node(argv: list[str]) -> int:
    """launch_server's real flow with fake scheduler / detokenizer targets and fake front end."""
    from launcher.log import configure_logging
    from srt.cli_args import parse_server_args
    from srt.launch_server import plan_launch, run

    install_fake_frontend()
    server_args = parse_server_args(argv)
    configure_logging(server_args.log_level, "main")
    return run(
        plan_launch(server_args), "launcher_targets:fake_scheduler", "launcher_targets:fake_detokenizer"
    )


if __name__ == "__main__":
    if sys.argv[1] == "node":
        sys.exit(fake_node(sys.argv[2:]))
    spawning_parent(sys.argv[2])
