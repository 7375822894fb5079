"""`--dp-size N`: N independent replicas of the TP x PP group on this node, behind SGLang's router.

    launch_server --dp-size 2 --port 30000              (this process: the controller)
     ├─ sglang::router                   on --host:--port; routes by prefix affinity and load
     ├─ launch_server   (replica DP0)    on 127.0.0.1:<free port>, pinned to the first half of the cores
     │   ├─ srt::scheduler_DP0_TP0 ...
     │   └─ srt::detokenizer_DP0
     └─ launch_server   (replica DP1)    the second half

Each replica is a whole launch_server with its own rendezvous, ranks and detokenizer, so no
collective ever spans two replicas, and each fails, restarts (--restart-on-failure) and replays
on its own. A replica that exits is logged with its exit and started again on the same port (at
most REPLICA_RESTARTS times within REPLICA_RESTART_WINDOW_S); meanwhile the router's health
checks take it out of rotation and its in-flight requests have ended with an error (or, with
--restart-on-failure, were replayed inside the replica). The router dying, or every replica
being down, takes the server down (exit 1). SIGTERM/SIGINT reaches the router and every
replica at once: each drains as a single server does, within --shutdown-timeout.

The router is sglang-router (the optional extra: `pip install -e ".[router]"`); without it
--dp-size > 1 is refused naming the extra.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

import requests

from launcher.layout import DP_RANK_ENV
from launcher.net import check_port_free
from launcher.process import describe_exit
from launcher.teardown import become_subreaper, kill_process_tree, set_parent_death_signal
from srt.utils import free_port

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

logger = logging.getLogger("srt.data_parallel")

REPLICA_RESTARTS = 3
REPLICA_RESTART_WINDOW_S = 300.0
POLL_S = 0.5
ROUTER_HEALTH_INTERVAL_S = 2  # how soon the router takes a dead replica out of rotation
# A dying replica answers 503 at once, and cache_aware keeps choosing it for the same prefix: the router's
# retries (five within a second by default) would all land there before the health check catches up.
# Two failures open the replica's circuit so the retries go to the others; it is tried again after a while.
ROUTER_CIRCUIT_FAILURES = 2
ROUTER_CIRCUIT_RETRY_S = 10
ROUTER_EXTRA = 'pip install -e ".[router]"'  # or: pip install sglang-router==0.3.2


def require_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError(
            f"--dp-size > 1 puts SGLang's router in front of the replicas, and sglang-router is not "
            f"installed: {ROUTER_EXTRA}"
        )


def split_cpus(cpus: Sequence[int], n: int) -> list[list[int]]:
    """n contiguous, about equal groups of `cpus` (each at least one CPU: with fewer CPUs than
    replicas, replicas share them round robin)."""
    cpus = sorted(cpus)
    if len(cpus) < n:
        return [[cpus[i % len(cpus)]] for i in range(n)]
    base, extra = divmod(len(cpus), n)
    groups, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        groups.append(cpus[start : start + size])
        start += size
    return groups


@dataclass
class Replica:
    rank: int
    port: int
    cpus: list[int]
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    secrets: dict[str, str] = field(default_factory=dict, repr=False)  # API keys, through the environment
    restarts: list[float] = field(default_factory=list)  # monotonic times of the restarts so far
    down: bool = False  # out of restarts: left down

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"replica DP{self.rank} ({self.url})"

    def start(self) -> None:
        cpus = self.cpus

        def in_child() -> None:
            set_parent_death_signal(signal.SIGKILL)  # the controller gone: the replica goes too
            os.sched_setaffinity(0, cpus)

        env = {**os.environ, **self.secrets, DP_RANK_ENV: str(self.rank)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "srt.launch_server", *self.argv], env=env, preexec_fn=in_child
        )

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False


class DataParallelController:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        groups = split_cpus(sorted(os.sched_getaffinity(0)), args.dp_size)
        self.replicas = []
        for rank, cpus in enumerate(groups):
            port = free_port()
            argv = args.to_cli(
                dp_size=1, host="127.0.0.1", port=port, **args.replica_memory_share(args.dp_size)
            )
            self.replicas.append(Replica(rank, port, cpus, argv, secrets=args.secret_env()))
        self.router: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()

    # ---- start-up ----
    def start(self) -> None:
        for replica in self.replicas:
            logger.info("starting %s on CPUs %s", replica.name, replica.cpus)
            replica.start()
        self._wait_healthy(self.replicas, self.args.dist_timeout + 900.0)
        self._start_router()

    def _wait_healthy(self, replicas: list[Replica], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(replicas)
        while pending:
            for replica in list(pending):
                assert replica.proc is not None
                code = replica.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"{replica.name} {describe_exit(code)} during start-up (its log is above)"
                    )
                if replica.healthy():
                    logger.info("%s is serving", replica.name)
                    pending.remove(replica)
            if self.stopping.wait(POLL_S):
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(r.name for r in pending)} not healthy within {timeout:.0f} s")

    def _start_router(self) -> None:
        args = self.args
        metrics_port = free_port()
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--worker-urls",
            *(r.url for r in self.replicas),
            "--policy",
            args.router_policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--health-check-interval-secs",
            str(ROUTER_HEALTH_INTERVAL_S),
            "--health-failure-threshold",
            "1",
            "--cb-failure-threshold",
            str(ROUTER_CIRCUIT_FAILURES),
            "--cb-timeout-duration-secs",
            str(ROUTER_CIRCUIT_RETRY_S),
            "--shutdown-grace-period-secs",
            str(int(args.shutdown_timeout) + 1),
            "--log-level",
            "debug" if args.log_level == "debug" else "warn",
        ]
        if args.api_key:  # clients give the router the key, and the router gives it to the replicas
            argv += ["--api-key", args.api_key]
        self.router = subprocess.Popen(argv, preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL))
        deadline = time.monotonic() + 60
        while True:
            if self.router.poll() is not None:
                raise RuntimeError(f"sglang-router {describe_exit(self.router.returncode)} during start-up")
            try:
                if requests.get(f"http://{_connect_host(args.host)}:{args.port}/readiness", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("sglang-router did not become ready within 60 s")
            if self.stopping.wait(POLL_S):
                raise KeyboardInterrupt
        logger.info(
            "serving on http://%s:%d: sglang-router (%s, its metrics on 127.0.0.1:%d) in front of %d "
            "replicas",
            args.host,
            args.port,
            args.router_policy,
            metrics_port,
            len(self.replicas),
        )

    # ---- supervision ----
    def supervise(self) -> int:
        """Until a signal (0) or a fatal loss (1)."""
        while not self.stopping.wait(POLL_S):
            assert self.router is not None
            if self.router.poll() is not None:
                logger.critical("sglang-router %s; shutting down", describe_exit(self.router.returncode))
                return 1
            for replica in self.replicas:
                if not replica.down and replica.proc is not None and replica.proc.poll() is not None:
                    self._replica_exited(replica)
            if all(r.down for r in self.replicas):
                logger.critical("every replica is down; shutting down")
                return 1
        return 0

    def _replica_exited(self, replica: Replica) -> None:
        assert replica.proc is not None
        how = describe_exit(replica.proc.returncode)
        now = time.monotonic()
        replica.restarts = [t for t in replica.restarts if now - t < REPLICA_RESTART_WINDOW_S]
        if len(replica.restarts) >= REPLICA_RESTARTS:
            replica.down = True
            logger.critical(
                "%s %s; it was restarted %d times within %.0f s already, so it stays down (the others "
                "keep serving)",
                replica.name,
                how,
                len(replica.restarts),
                REPLICA_RESTART_WINDOW_S,
            )
            return
        replica.restarts.append(now)
        logger.critical(
            "%s %s; the router routes around it; starting it again (restart %d of at most %d within %.0f s)",
            replica.name,
            how,
            len(replica.restarts),
            REPLICA_RESTARTS,
            REPLICA_RESTART_WINDOW_S,
        )
        replica.start()

    # ---- shutdown ----
    def stop(self) -> None:
        """SIGTERM to the router and every replica (each drains), then SIGKILL what is left."""
        procs = [
            p for p in [self.router, *(r.proc for r in self.replicas)] if p is not None and p.poll() is None
        ]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + 10
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        kill_process_tree(os.getpid(), include_self=False, timeout=5.0)


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def run_data_parallel(args: ServerArgs) -> int:
    """The controller's life: start the replicas, then the router; supervise; tear down. Exit code
    0 after SIGTERM/SIGINT, 1 when start-up fails or the server is lost."""
    become_subreaper()
    controller = DataParallelController(args)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s; stopping the router and the replicas", signal.Signals(signum).name)
        controller.stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        controller.start()
        return controller.supervise()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as error:
        logger.error("launch failed: %s", error)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        controller.stop()


def check_data_parallel(args: ServerArgs) -> None:
    """ValueError naming what to fix, before anything starts."""
    require_router()
    check_port_free(args.host, args.port)
