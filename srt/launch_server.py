"""`launch_server` / `python -m srt.launch_server`: start one node of the server.

Node 0: one scheduler per local rank + the detokenizer (none with --is-embedding) as children, the
TokenizerManager and the HTTP server in this process. Nodes with --node-rank > 0: only their schedulers; this process
just supervises them. Before any child starts, every node meets the others at the rendezvous
(launcher.rendezvous: duplicate node ranks and differing configurations fail there). Any child's
death, or another node going down, takes the node down (launcher.supervisor, launcher.peers);
with --restart-on-failure a child's death on any node restarts the engine on every node instead
(srt/recovery.py).

With --dp-size N > 1 this process is the controller of N such servers (replicas) behind SGLang's
router instead (launcher/data_parallel.py).

Exit codes: 0 after SIGTERM/SIGINT, 1 when start-up fails or a child dies, 2 for bad arguments.
A signal while serving starts a graceful shutdown (http_server.DrainingServer): new requests get
503, the ones in flight finish within --shutdown-timeout or are failed with a 503, and the exit
code is still 0, since the shutdown was asked for. A second signal stops at once. A signal
before the HTTP server is up (models loading) stops at once, also with 0. Either way every child
is torn down before the process exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any

from launcher.child import ChildSpec
from launcher.fingerprint import code_version, launch_fingerprint
from launcher.layout import (
    RankInfo,
    RendezvousAddress,
    check_device_count,
    dp_rank_label,
    local_ranks,
    node_of_world_rank,
    output_world_rank,
    rendezvous_address,
    resolve_init_method,
)
from launcher.log import configure_logging
from launcher.metrics_relay import MetricsRelay, RemoteMetrics
from launcher.net import bind_listener, check_port_free
from launcher.peers import PeerWatch
from launcher.process import ChildProcess, LaunchError, spawn_child, stop_children, wait_ready
from launcher.rendezvous import USE_AGENT_STORE, Rendezvous
from launcher.supervisor import Supervisor
from launcher.teardown import become_subreaper, kill_process_tree
from srt.cli_args import parse_server_args
from srt.metrics import metrics_dir, render_rank_metrics
from srt.recovery import EngineRestarter
from srt.server_args import PortArgs, ServerArgs
from srt.utils import rank_cpus

logger = logging.getLogger("srt.launch_server")

SCHEDULER_TARGET = "scheduler.entry:run_scheduler_process"
DETOKENIZER_TARGET = "srt.detokenizer:run_detokenizer_process"
MODEL_INFO_KEYS = (
    "context_length",
    "vocab_size",
    "max_total_tokens",
    "eos_token_ids",
    "max_running_requests",
)
MODEL_LOAD_BUDGET_S = 900.0  # start-up may take the rendezvous (--dist-timeout) plus this


class Shutdown(Exception):
    """SIGTERM or SIGINT arrived outside the HTTP server's own handling (which drains)."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything resolved once, before any child starts."""

    server_args: ServerArgs
    port_args: PortArgs
    model_dir: str
    tokenizer_path: str
    ranks: tuple[RankInfo, ...]
    rendezvous: RendezvousAddress  # node 0's launcher hosts the store there

    @property
    def ipc_dir(self) -> Path:
        return Path(self.port_args.tokenizer_ipc.removeprefix("ipc://")).parent


def plan_launch(server_args: ServerArgs) -> LaunchPlan:
    """Raises ValueError (naming the flag) for anything the user must fix."""
    if server_args.node_rank == 0:
        check_port_free(server_args.host, server_args.port)
    ranks = local_ranks(
        server_args.tp_size,
        server_args.pp_size,
        server_args.nnodes,
        server_args.node_rank,
        server_args.device,
    )
    rank_cpus(
        len(ranks), server_args.cpu_threads
    )  # a bad SGLANG_CPU_OMP_THREADS_BIND fails here, before any child
    if server_args.device == "cuda":
        import torch

        check_device_count(len(ranks), torch.cuda.device_count(), server_args.nnodes)
    init_method = resolve_init_method(server_args.dist_init_addr, server_args.nnodes, server_args.port)
    rendezvous = rendezvous_address(init_method, os.environ)
    if server_args.node_rank == 0 and rendezvous.port == server_args.port and server_args.dist_init_addr:
        raise ValueError(f"--dist-init-addr and --port both name port {server_args.port}; node 0 needs both")
    from model_executor.loader.model_path import resolve_model_path

    model_dir = str(resolve_model_path(server_args.model_path))
    if server_args.speculative_draft_model_path is not None:  # a GGUF draft is converted once, here
        draft_dir = str(
            resolve_model_path(server_args.speculative_draft_model_path, "--speculative-draft-model-path")
        )
        server_args = dataclasses.replace(server_args, speculative_draft_model_path=draft_dir)
    return LaunchPlan(
        server_args,
        PortArgs.create(init_method),
        model_dir,
        server_args.tokenizer_path or model_dir,
        tuple(ranks),
        rendezvous,
    )


def child_specs(
    plan: LaunchPlan, scheduler_target: str = SCHEDULER_TARGET, detokenizer_target: str = DETOKENIZER_TARGET
) -> list[ChildSpec]:
    args = plan.server_args
    threads = rank_cpus(len(plan.ranks), args.cpu_threads)
    specs = [
        ChildSpec(
            name=rank.name,
            title=rank.title,
            target=scheduler_target,
            num_threads=num_threads,
            cpus=cpus,
            args=(args, plan.port_args, plan.model_dir, rank),
            log_level=args.log_level,
        )
        for rank, (num_threads, cpus) in zip(plan.ranks, threads, strict=True)
    ]
    if args.node_rank == 0 and not args.is_embedding:  # an embedding has no text to decode
        replica = dp_rank_label()
        specs.append(
            ChildSpec(
                name="detokenizer",
                title="srt::detokenizer" + (f"_{replica}" if replica else ""),
                target=detokenizer_target,
                args=(args, plan.port_args, plan.tokenizer_path),
                log_level=args.log_level,
            )
        )
    return specs


def merge_model_info(plan: LaunchPlan, infos: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's ready info, overlaid with the output rank's (when on this node)."""
    by_world_rank = {rank.world_rank: infos.get(rank.name, {}) for rank in plan.ranks}
    model_info: dict[str, Any] = {}
    for world_rank in (0, output_world_rank(plan.server_args.tp_size, plan.server_args.pp_size)):
        model_info.update(by_world_rank.get(world_rank, {}))
    missing = [key for key in MODEL_INFO_KEYS if key not in model_info]
    if missing:
        raise LaunchError(f"the schedulers' ready info lacks {', '.join(missing)}")
    return model_info


class Frontend:
    """Node 0's TokenizerManager, as the Supervisor's failure callback reaches it from its thread."""

    def __init__(self) -> None:
        self.tm: Any = None

    def fail_all(self, message: str) -> None:
        tm = self.tm
        if tm is None:
            return
        loop = getattr(tm, "loop", None)
        if loop is None or not loop.is_running():
            tm.fail_all(message)  # not serving yet: no request in flight, no loop to race with
            return
        done = threading.Event()

        def fail_on_loop() -> None:
            try:
                tm.fail_all(message)
            finally:
                done.set()

        loop.call_soon_threadsafe(fail_on_loop)
        if not done.wait(2.0):
            logger.error("the TokenizerManager did not run fail_all within 2 s")


def _raise_shutdown(signum: int, frame: FrameType | None) -> None:
    raise Shutdown(signal.Signals(signum).name)


def _exit_now(plan: LaunchPlan, code: int) -> None:
    """Supervisor's last step after a child died: nothing of this node may outlive it."""
    kill_process_tree(os.getpid(), include_self=False, timeout=2.0)
    shutil.rmtree(plan.ipc_dir, ignore_errors=True)
    logging.shutdown()
    os._exit(code)


def meet_other_nodes(plan: LaunchPlan) -> PeerWatch:
    """The rendezvous (on every node, even alone), then the watch on the other nodes."""
    args = plan.server_args
    rendezvous = Rendezvous.join(
        plan.rendezvous,
        args.node_rank,
        args.nnodes,
        launch_fingerprint(args, plan.model_dir),
        args.dist_timeout,
    )
    os.environ[USE_AGENT_STORE] = "True"  # the ranks join that store as clients (launcher/rendezvous.py)
    return PeerWatch(rendezvous, report_lost=args.restart_on_failure > 0).start()


def route_outputs_across_nodes(plan: LaunchPlan, rendezvous: Rendezvous) -> LaunchPlan:
    """With pipeline stages over several nodes the output rank (TP 0 of the last stage) runs on
    another node than the detokenizer: node 0's detokenizer then listens on TCP at the rendezvous
    host, and publishes where in the rendezvous store."""
    args = plan.server_args
    output_node = node_of_world_rank(
        output_world_rank(args.tp_size, args.pp_size), args.world_size, args.nnodes
    )
    if output_node == 0:
        return plan
    if args.node_rank == 0:
        host = socket.gethostbyname(plan.rendezvous.host)
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        rendezvous.publish("detokenizer", f"tcp://{host}:{port}")
    endpoint = rendezvous.read("detokenizer", args.dist_timeout)
    logger.info("the output rank on node %d reaches the detokenizer at %s", output_node, endpoint)
    return dataclasses.replace(plan, port_args=dataclasses.replace(plan.port_args, detokenizer_ipc=endpoint))


def start_again(
    plan: LaunchPlan,
    children: list[ChildProcess],
    scheduler_target: str,
    detokenizer_target: str,
    abort: Sequence[Connection] = (),
) -> list[ChildProcess]:
    """An engine restart (srt/recovery.py, in the Supervisor's thread): every child again;
    `children`, which the final teardown kills, holds the new ones from now on. A message on one of
    `abort` (another node went down, or restarts again) fails the start at once."""
    children[:] = [spawn_child(spec) for spec in child_specs(plan, scheduler_target, detokenizer_target)]
    try:
        wait_ready(children, plan.server_args.dist_timeout + MODEL_LOAD_BUDGET_S, abort)
    except LaunchError:
        stop_children(children)
        raise
    return list(children)


def run(
    plan: LaunchPlan, scheduler_target: str = SCHEDULER_TARGET, detokenizer_target: str = DETOKENIZER_TARGET
) -> int:
    """Start, serve (node 0) or supervise (node > 0), tear down. Returns the exit code."""
    args = plan.server_args
    become_subreaper()  # children of a dead child come to us, so teardown still finds them
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_shutdown)
    children: list[ChildProcess] = []
    frontend = Frontend()
    supervisor: Supervisor | None = None
    peers: PeerWatch | None = None
    farewell = f"node {args.node_rank} shut down"  # what the other nodes are told when this one exits
    deliberate = False  # a signal asked for the exit (then node 0 going down is a clean exit for the others)
    listener: socket.socket | None = None
    try:
        if args.node_rank == 0:  # held from now on, so that no child's ephemeral port can take it
            try:
                listener = bind_listener(args.host, args.port)
            except ValueError as e:
                raise LaunchError(str(e)) from None
        peers = meet_other_nodes(plan)
        plan = route_outputs_across_nodes(plan, peers.rdzv)
        for spec in child_specs(plan, scheduler_target, detokenizer_target):
            children.append(spawn_child(spec))
        infos = wait_ready(children, args.dist_timeout + MODEL_LOAD_BUDGET_S, abort=[peers.failures])
        logger.info("%d child processes ready", len(children))
        watch = peers
        restarter = EngineRestarter(
            args,
            lambda: start_again(
                plan, children, scheduler_target, detokenizer_target, [watch.failures, watch.restarts]
            ),
            lambda: frontend.tm,
            peers,
        )
        supervisor = Supervisor(
            children,
            frontend.fail_all,
            exit_fn=lambda code: _exit_now(plan, 0 if watch.leader_stopped else code),
            explain=peers.explain,
            peer_failure=peers.failures,
            peer_restart=peers.restarts if args.restart_on_failure else None,
            restart=restarter.restart if args.restart_on_failure else None,
        )
        supervisor.start()
        if args.node_rank > 0:
            if args.enable_metrics:  # node 0's /metrics shows this node's ranks too
                MetricsRelay(
                    plan.rendezvous, args.node_rank, lambda: render_rank_metrics(metrics_dir(plan.port_args))
                ).start()
            threading.Event().wait()  # until a signal, or the Supervisor ends the process
        remote = (
            RemoteMetrics(plan.rendezvous, args.nnodes) if args.enable_metrics and args.nnodes > 1 else None
        )
        assert listener is not None
        return serve(plan, merge_model_info(plan, infos), frontend, listener, remote, children)
    except LaunchError as e:
        logger.error("launch failed: %s", e)
        farewell = f"node {args.node_rank} failed to start: {e}"
        return 1
    except Shutdown as e:
        logger.info("received %s; shutting down", e)
        farewell, deliberate = f"node {args.node_rank} received {e}", True
        return 0
    except SystemExit as e:  # uvicorn exits 1 when it cannot bind
        return e.code if isinstance(e.code, int) else 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        if supervisor is not None:
            supervisor.stop()
        if peers is not None:
            peers.announce(farewell, deliberate)
        stop_children(children)
        kill_process_tree(os.getpid(), include_self=False, timeout=2.0)
        shutil.rmtree(plan.ipc_dir, ignore_errors=True)
        if listener is not None:
            listener.close()


def serve(
    plan: LaunchPlan,
    model_info: dict[str, Any],
    frontend: Frontend,
    listener: socket.socket,
    remote_metrics: RemoteMetrics | None = None,
    children: list[ChildProcess] | None = None,
) -> int:
    from srt.http_server import create_app, run_http_server
    from srt.tokenizer_manager import TokenizerManager

    args = plan.server_args
    frontend.tm = TokenizerManager(args, plan.port_args, plan.tokenizer_path, model_info)
    kids = children if children is not None else []  # an engine restart replaces its items in place
    frontend.tm.processes = lambda: [("main", os.getpid())] + [(child.name, child.pid) for child in kids]
    if remote_metrics is not None and frontend.tm.metrics is not None:
        frontend.tm.metrics.nodes.remote = remote_metrics.texts
    server_info = {
        **args.to_dict(),
        **model_info,
        "model_dir": plan.model_dir,
        "tokenizer_path": plan.tokenizer_path,
        "version": code_version(),
    }
    app = create_app(frontend.tm, server_info)
    logger.info("serving on http://%s:%d", args.host, args.port)
    run_http_server(app, listener, args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        server_args = parse_server_args(argv)
        replica = dp_rank_label()
        configure_logging(server_args.log_level, f"main_{replica}" if replica else "main")
        if server_args.dp_size > 1:
            from launcher.data_parallel import check_data_parallel, run_data_parallel

            check_data_parallel(server_args)
        else:
            plan = plan_launch(server_args)
    except ValueError as e:
        print(f"launch_server: error: {e}", file=sys.stderr)
        return 2
    if server_args.dp_size > 1:
        return run_data_parallel(server_args)
    return run(plan)


if __name__ == "__main__":
    sys.exit(main())
