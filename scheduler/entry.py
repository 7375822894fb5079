"""The scheduler process: distributed start-up, model, sockets, readiness, then the loop."""

from __future__ import annotations

import dataclasses
import functools
import logging
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import zmq

import consensus
from model_executor.distributed.parallel_state import init_distributed
from model_executor.model_runner import ModelRunner, RunnerConfig
from scheduler.fault_injection import FaultInjector
from scheduler.pipeline import PipelineScheduler
from scheduler.receiver import RequestReceiver
from scheduler.scheduler import Scheduler
from scheduler.watchdog import Watchdog
from srt.metrics import RankMetrics, enable_multiprocess_metrics, metrics_dir
from srt.server_args import PortArgs, ServerArgs
from srt.tokenizer_loader import load_tokenizer
from srt.utils import engine_start, resolve_dtype

logger = logging.getLogger("srt.scheduler")


def runner_config(args: ServerArgs, model_dir: Path) -> RunnerConfig:
    return RunnerConfig(
        model_dir=model_dir,
        dtype=resolve_dtype(args.dtype, args.device),
        device=args.device,
        page_size=args.page_size,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens,
        cpu_kvcache_space=args.cpu_kvcache_space,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        attention_backend=args.attention_backend,
        # host RAM is shared by a node's ranks; on CUDA each rank measures its own device's memory
        local_world_size=args.ranks_per_node if args.device == "cpu" else 1,
        quantization=args.quantization,
        deterministic=args.deterministic,
        fixed_order_sum=args.speculative_algorithm is not None,
        adaptive_threads=not args.disable_adaptive_cpu_threads,
        return_routed_experts=args.enable_return_routed_experts,
        is_embedding=args.is_embedding,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        disable_hybrid_swa_memory=args.disable_hybrid_swa_memory,
        chunked_prefill_size=args.chunked_prefill_size,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_bs=args.cuda_graph_bs,
        disable_cuda_graph=args.disable_cuda_graph,
        lora_adapters=args.lora_adapters if args.lora_enabled else None,
        max_lora_rank=args.max_lora_rank,
    )


def start_watchdogs(args: ServerArgs, scheduler: Scheduler, name: str) -> list[Watchdog]:
    def busy() -> bool:
        return scheduler.has_work()

    def describe() -> str:
        chunked = scheduler.chunked_req
        return (
            f"step {scheduler.forward_steps}, running {[r.rid for r in list(scheduler.running)]}, "
            f"waiting {[r.rid for r in list(scheduler.waiting)]}, chunked {chunked.rid if chunked else None}"
        )

    dogs = [
        Watchdog(
            name=name,
            timeout_s=args.watchdog_timeout,
            soft=False,
            progress=lambda: scheduler.forward_steps,
            busy=busy,
            describe=describe,
        )
    ]
    if args.soft_watchdog_timeout is not None:
        dogs.append(
            Watchdog(
                name=name,
                timeout_s=args.soft_watchdog_timeout,
                soft=True,
                progress=lambda: scheduler.forward_steps,
                busy=busy,
                describe=describe,
            )
        )
    return [dog.start() for dog in dogs]


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, model_dir: str, rank_info: Any, ready_conn: Connection
) -> None:
    tp_rank, pp_rank = int(rank_info.tp_rank), int(rank_info.pp_rank)
    world_rank = server_args.tp_size * pp_rank + tp_rank
    try:
        FaultInjector(world_rank).at_startup()
        device = torch.device(server_args.device)
        parallel = init_distributed(
            tp_size=server_args.tp_size,
            pp_size=server_args.pp_size,
            world_rank=world_rank,
            init_method=port_args.dist_init_method,
            device=device,
            timeout_s=server_args.dist_timeout,
            store_prefix=f"srt/engine/{engine_start()}/",  # a restart meets on the same store afresh
        )
        if server_args.enable_rank_consensus_checker:
            # Collective over the whole world: every rank creates these groups at the same point.
            consensus.enable(
                consensus.create_groups(
                    server_args.tp_size, server_args.pp_size, world_rank, timeout_s=server_args.dist_timeout
                )
            )
        runner = ModelRunner(runner_config(server_args, Path(model_dir)), parallel)
        # With pipeline stages the broadcast covers stage 0; the stages pass messages on themselves.
        receiver = RequestReceiver(
            parallel.tp if server_args.pp_size > 1 else parallel.world,
            port_args.tokenizer_ipc if world_rank == 0 else None,
        )
        is_output_rank = tp_rank == 0 and pp_rank == server_args.pp_size - 1
        send: Any = None
        if is_output_rank:
            context = zmq.Context(1)
            out_socket = context.socket(zmq.PUSH)
            out_socket.connect(port_args.detokenizer_ipc)

            def send(obj: Any) -> None:
                out_socket.send_pyobj(obj)

        tokenizer_path = server_args.tokenizer_path or model_dir
        info = runner.info
        eos = set(info.eos_token_ids)

        # called on a stop string's first need
        tokenizer_loader = functools.partial(load_tokenizer, tokenizer_path)
        metrics = None
        if server_args.enable_metrics:
            enable_multiprocess_metrics(metrics_dir(port_args))
            metrics = RankMetrics(world_rank, is_output_rank)
        if server_args.pp_size > 1:
            scheduler: Scheduler = PipelineScheduler(
                server_args,
                parallel,
                runner,
                receiver,
                send,
                eos,
                tokenizer_loader,
                metrics,
                micro_batches=server_args.pp_micro_batches or server_args.pp_size,
            )
        else:
            scheduler = Scheduler(
                server_args, parallel, runner, receiver, send, eos, tokenizer_loader, metrics
            )
    except Exception:
        logger.exception("scheduler rank TP%d PP%d failed during start-up", tp_rank, pp_rank)
        ready_conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    ready_conn.send(("ready", {**dataclasses.asdict(info), "model_path": model_dir}))
    start_watchdogs(server_args, scheduler, getattr(rank_info, "name", f"scheduler TP{tp_rank}"))
    try:
        scheduler.event_loop()
    except Exception:
        logger.exception("scheduler rank TP%d PP%d crashed", tp_rank, pp_rank)
        checker = consensus.get_checker()
        if checker is not None:  # a divergence would explain the crash: let the checker say so first
            checker.settle(timeout_s=5 * checker.interval_s + 5.0)  # generous: a loaded machine is slow
        raise SystemExit(1) from None
