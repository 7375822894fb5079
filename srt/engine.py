"""The offline engine: generate from token ids without a server, on the server's own Scheduler.

At tp_size 1 the Scheduler runs in this process: `generate` queues a call's requests and steps it
until every one has finished. With tp_size > 1 it spawns one process per rank, each running the
server's scheduler process (scheduler/entry.py); the engine stands where a server's tokenizer
manager and detokenizer stand: it pushes a call's requests to rank 0 in one message (so every rank
admits them in the same step) and pulls the output rank's token ids.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import zmq
from tqdm import tqdm

from launcher.child import set_up_threads
from launcher.layout import local_ranks
from model_executor.distributed.parallel_state import single_process_state
from model_executor.loader.model_path import resolve_model_path
from model_executor.loader.weight_source import eos_token_ids
from model_executor.model_runner import ModelRunner, RunnerConfig
from scheduler.entry import run_scheduler_process, runner_config
from scheduler.receiver import RequestReceiver
from scheduler.scheduler import Scheduler
from srt.generate_parse import is_int
from srt.io_struct import BatchTokenIDOut, FinishReason, TokenizedGenerateReq
from srt.sampling_params import SamplingParams
from srt.server_args import PortArgs, ServerArgs
from srt.tokenizer_loader import load_tokenizer
from srt.utils import free_port, rank_cpus, resolve_dtype

logger = logging.getLogger("srt.engine")


@dataclass
class GenerateOutput:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int


class _Inbox(RequestReceiver):
    """The in-process Scheduler's receiver: the requests `generate` queued, handed over at once."""

    def __init__(self) -> None:  # no socket and no group: one rank, in this process
        self.messages: list[Any] = []

    def recv(self, wait_ms: int) -> list[Any]:
        messages, self.messages = self.messages, []
        return messages


class _Outputs:
    """One `generate` call's token ids, gathered from the Scheduler's BatchTokenIDOut messages."""

    def __init__(self, reqs: list[TokenizedGenerateReq]) -> None:
        self.rids = [r.rid for r in reqs]
        self.ids: dict[str, list[int]] = {rid: [] for rid in self.rids}
        self.finished: dict[str, tuple[FinishReason, int]] = {}

    def add(self, out: Any) -> None:
        if not isinstance(out, BatchTokenIDOut):
            return
        for i, rid in enumerate(out.rids):
            if rid not in self.ids:
                continue
            self.ids[rid].extend(out.new_token_ids[i])
            reason = out.finished_reasons[i]
            if reason is not None:
                self.finished[rid] = (reason, out.prompt_tokens[i])

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.rids)

    def results(self) -> list[GenerateOutput]:
        for i, rid in enumerate(self.rids):
            reason, prompt_tokens = self.finished[rid]
            if reason.type == "abort":
                raise RuntimeError(f"prompt {i} ({prompt_tokens} tokens) was aborted: {reason.message}")
        return [
            GenerateOutput(self.ids[rid], self.finished[rid][0].type, self.finished[rid][1])
            for rid in self.rids
        ]


def _check_prompts(prompts: object) -> None:
    """Engine.generate takes token ids; anything else is refused by name before a step runs."""
    if not isinstance(prompts, list):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            raise TypeError(
                f"prompts[{i}] is a str: the offline Engine takes token ids (tokenize the text first)"
            )
        if not isinstance(prompt, (list, tuple)) or not all(is_int(t) for t in prompt):
            raise TypeError(f"prompts[{i}] must be a list of int token ids")


class Engine:
    """`Engine(model_path=None, tp_size=1, dtype="auto").generate(prompts, params)`.

    model_path None means the bundled SmolLM2-135M-Instruct.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        tp_size: int = 1,
        dtype: str = "auto",
        device: str = "cpu",
        page_size: int = 1,
        max_total_tokens: int | None = None,
        mem_fraction_static: float | None = None,
        max_running_requests: int = 256,
        random_seed: int = 0,
        max_prefill_tokens: int = 4096,
        context_length: int | None = None,
        start_timeout_s: float = 300.0,
        quantization: str | None = None,
        speculative_algorithm: str | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculative_draft_model_path: str | None = None,
        disable_hybrid_swa_memory: bool = False,
    ) -> None:

        self.model_dir = resolve_model_path(model_path)
        self.tp_size = tp_size
        self.random_seed = random_seed
        self.max_prefill_tokens = max_prefill_tokens
        self._requests_seen = 0
        torch_dtype = resolve_dtype(dtype, device)
        # The server's options for the same run. Each prompt is prefilled whole, with no prefix
        # cache, so a call's outputs do not depend on the calls before it; a prompt may take the
        # whole prefill budget (longer ones are chunked).
        self.args = ServerArgs(
            model_path=str(self.model_dir),
            tp_size=tp_size,
            device=device,
            dtype="auto" if dtype == "auto" else str(torch_dtype).removeprefix("torch."),
            page_size=page_size,
            max_total_tokens=max_total_tokens,
            mem_fraction_static=mem_fraction_static,
            cpu_kvcache_space=None,  # not $VLLM_CPU_KVCACHE_SPACE: the engine's budget comes from its arguments
            max_running_requests=max_running_requests,
            random_seed=random_seed,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=max_prefill_tokens,
            context_length=context_length,
            quantization=quantization,
            disable_radix_cache=True,
            speculative_algorithm=speculative_algorithm,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            speculative_draft_model_path=None
            if speculative_draft_model_path is None
            else str(resolve_model_path(speculative_draft_model_path, "speculative_draft_model_path")),
            disable_hybrid_swa_memory=disable_hybrid_swa_memory,
        )
        self.config: RunnerConfig = runner_config(self.args, self.model_dir)
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        self._procs: list[Any] = []
        if tp_size == 1:
            self.runner = ModelRunner(self.config)
            self._inbox = _Inbox()
            self._outbox: list[Any] = []
            self.scheduler = Scheduler(
                self.args,
                single_process_state(),
                self.runner,
                self._inbox,
                self._outbox.append,
                eos_token_ids(self.model_dir, self.runner.hf_config),
                functools.partial(load_tokenizer, str(self.model_dir)),  # on a stop string's first need
            )
            self.context_length = self.runner.context_length
            return
        self._start_ranks(start_timeout_s)
        self.context_length = int(self.runner_info["context_length"])

    def _start_ranks(self, timeout_s: float) -> None:
        """Spawns the ranks, each running the server's scheduler process, and waits until every
        one is ready. The engine binds where a server's detokenizer binds (the output rank pushes
        its token ids there) and connects where its tokenizer manager connects (rank 0's inbox)."""
        ctx = mp.get_context("spawn")
        self._port_args = PortArgs.create(f"tcp://127.0.0.1:{free_port()}")
        self._zmq = zmq.Context(1)
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.bind(self._port_args.detokenizer_ipc)
        self._requests = self._zmq.socket(zmq.PUSH)
        self._requests.connect(self._port_args.tokenizer_ipc)
        ready: dict[Connection, int] = {}
        ranks = local_ranks(self.tp_size, 1, device_type=torch.device(self.args.device).type)
        for rank, (threads, cpus) in zip(ranks, rank_cpus(len(ranks), self.args.cpu_threads), strict=True):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                daemon=True,
                args=(f"engine rank TP{rank.tp_rank}", threads, cpus, self.args, self._port_args)
                + (str(self.model_dir), rank, writer),
            )
            proc.start()
            writer.close()  # the rank holds the other end: its exit ends the pipe
            self._procs.append(proc)
            ready[reader] = rank.tp_rank
        infos: dict[int, dict[str, Any]] = {}

        def poll_ready(timeout: float) -> tuple[str, Any] | None:
            if not ready:
                time.sleep(timeout)
            for conn in wait(list(ready), timeout) if ready else []:
                assert isinstance(conn, Connection)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):  # the rank is gone: its exit code comes next
                    ready.pop(conn)
                    continue
                if kind != "ready":
                    return kind, payload
                infos[ready.pop(conn)] = payload
            return ("ready", infos[0]) if len(infos) == self.tp_size else None

        status = self._wait("during start-up", poll_ready, timeout_s)
        if status[0] != "ready":
            self.shutdown()
            raise RuntimeError(f"rank start-up failed: {status[1]}")
        self.runner_info: dict[str, Any] = status[1]

    def _recv_output(self, timeout: float) -> Any:
        return self._outputs.recv_pyobj() if self._outputs.poll(int(timeout * 1000)) else None

    def _wait(self, during: str, poll: Callable[[float], Any], timeout_s: float | None = None) -> Any:
        """What `poll` gets next from the ranks, watching every rank meanwhile: a rank that exits
        first (or nothing within `timeout_s`) shuts the others down and raises, naming it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            got = poll(POLL_S)
            if got is not None:
                return got
            dead = self._dead_ranks()
            if dead:
                got = poll(0)  # what a rank sent before it exited (a start-up error)
                if got is not None:
                    return got
                self.shutdown()
                why = f"tensor-parallel {_describe(dead)} {during}"
                if any(code > 0 for _, code in dead):
                    why += f" (its traceback is in the log above{SPAWN_HINT if during == 'during start-up' else ''})"
                raise RuntimeError(why)
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"tensor-parallel ranks did not start within {timeout_s} s")

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        if params is None:
            params = SamplingParams()
        _check_prompts(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(
                f"params: {len(plist)} SamplingParams for {len(prompts)} prompts; give one, or one each"
            )
        constrained = next((p.grammar.kind for p in plist if p.grammar is not None), None)
        if constrained is not None:
            raise ValueError(f"{constrained}: the offline Engine does not constrain outputs; serve the model")
        for i, (prompt, sp) in enumerate(zip(prompts, plist)):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) + sp.max_new_tokens > self.context_length:
                raise ValueError(
                    f"prompt ({len(prompt)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                    f"exceeds the context length ({self.context_length})"
                )
        first = self._requests_seen
        self._requests_seen += len(prompts)
        reqs = [
            TokenizedGenerateReq(
                f"engine-{first + i}",
                list(prompt),
                sp,
                sp.seed if sp.seed is not None else self.random_seed * 1_000_003 + first + i,
            )
            for i, (prompt, sp) in enumerate(zip(prompts, plist))
        ]
        outputs = _Outputs(reqs)
        if self.scheduler is not None:
            self._inbox.messages += reqs
            try:
                while not outputs.done:
                    self.scheduler.step()
                    for out in self._outbox:
                        outputs.add(out)
                    self._outbox.clear()
                    if not (outputs.done or self.scheduler.has_work()):
                        raise RuntimeError("the scheduler went idle before every request finished")
            finally:  # the caller's torch threads as it set them, whatever the governor chose
                if self.runner is not None:
                    self.runner.wing.restore_threads()
            return outputs.results()
        if not self._procs:
            raise RuntimeError("the engine is shut down")
        self._requests.send_pyobj(reqs)  # one message: rank 0 hands them to every rank in the same step
        while not outputs.done:
            outputs.add(self._wait("during generation", self._recv_output))
        return outputs.results()

    def _dead_ranks(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the ranks that have exited, those a signal ended first (the rank
        lost first, the others fail after it)."""
        dead = [(rank, proc.exitcode) for rank, proc in enumerate(self._procs) if proc.exitcode is not None]
        return sorted(dead, key=lambda d: (d[1] >= 0, d[0]))

    def shutdown(self) -> None:
        if self._procs:
            # The scheduler loop runs until killed, as a server's does. Rank 0 last: it alone waits
            # on its socket, where the others would see a peer gone and log a crash.
            for proc in reversed(self._procs):
                proc.kill()
            for proc in self._procs:
                proc.join(timeout=10)
            self._procs = []
            self._requests.close(linger=0)
            self._outputs.close(linger=0)
            self._zmq.term()
            shutil.rmtree(
                Path(self._port_args.tokenizer_ipc.removeprefix("ipc://")).parent, ignore_errors=True
            )

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


POLL_S = 0.2  # how often a waiting Engine checks that its ranks are alive
SPAWN_HINT = (
    "; if it says that a new process started before the current one finished bootstrapping: ranks "
    "start by multiprocessing's spawn, which imports the main module again, so a script must create an "
    'Engine with tp_size > 1 under `if __name__ == "__main__":`'
)


def _describe(dead: list[tuple[int, int]]) -> str:
    """'rank 1 exited by signal SIGKILL, rank 0 exited with code 1'"""

    def reason(code: int) -> str:
        if code >= 0:
            return f"with code {code}"
        try:
            return f"by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"by signal {-code}"

    return ", ".join(f"rank {rank} exited {reason(code)}" for rank, code in dead)


def _rank_main(name: str, threads: int, cpus: frozenset[int] | None, *args: Any) -> None:
    """One spawned rank: the server's scheduler process (start-up, ready message, the loop), until
    `shutdown` kills it."""
    set_up_threads(name, threads, cpus)
    # tqdm's default lock is a named semaphore that a killed process leaves behind (the resource
    # tracker then warns of it at exit); the weight loader's progress bars need no more than this.
    tqdm.set_lock(threading.RLock())

    run_scheduler_process(*args)
