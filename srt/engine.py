"""The offline engine: generate from token ids without a server.

With tp_size > 1 it spawns one process per rank. Only rank 0 hears the caller; it broadcasts each
command over the gloo group and every rank runs the same deterministic generation loop (Model B
in miniature), so all ranks issue the same collectives in the same order.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from model_executor.distributed.parallel_state import destroy_distributed, init_distributed
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.loader.weight_source import eos_token_ids, resolve_model_path
from model_executor.model_runner import ModelRunner, RunnerConfig
from model_executor.sampler import SamplingBatchInfo, apply_logit_bias, apply_penalties, ban_tokens
from srt.sampling_params import SamplingParams
from srt.utils import free_port, resolve_dtype, threads_per_rank

logger = logging.getLogger("srt.engine")

@dataclass
class GenerateOutput:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int


@dataclass
class _Running:
    index: int
    input_ids: list[int]
    params: SamplingParams
    seed: int
    row: int = -1
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def seq_len(self) -> int:  # tokens whose KV is (or is about to be) in the pool
        return len(self.input_ids) + len(self.output_ids)


def run_generation(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams],
                   seeds: list[int], max_prefill_tokens: int = 4096) -> list[GenerateOutput]:
    """Prefills every prompt (grouped under a token budget), then decodes them together until each
    stops. Every rank calling this with the same arguments runs the same steps."""
    eos = eos_token_ids(runner.config.model_dir, runner.hf_config)
    reqs = [_Running(i, list(p), sp, s) for i, (p, sp, s) in enumerate(zip(prompts, params, seeds))]
    for r in reqs:
        if len(r.input_ids) + r.params.max_new_tokens > runner.context_length:
            raise ValueError(f"prompt ({len(r.input_ids)} tokens) + max_new_tokens ({r.params.max_new_tokens}) "
                             f"exceeds the context length ({runner.context_length})")
        if r.params.max_new_tokens == 0:
            r.finish_reason = "length"
    pending = [r for r in reqs if r.finish_reason is None]
    running: list[_Running] = []
    while pending:
        group: list[_Running] = []
        tokens = 0
        while pending and (not group or tokens + len(pending[0].input_ids) <= max_prefill_tokens) \
                and len(running) + len(group) < runner.max_running_requests:
            tokens += len(pending[0].input_ids)
            group.append(pending.pop(0))
        if not group:
            raise RuntimeError("no request slot free for prefill")
        _step(runner, group, ForwardMode.EXTEND, eos)
        running += [r for r in group if r.finish_reason is None]
    while running:
        _step(runner, running, ForwardMode.DECODE, eos)
        running = [r for r in running if r.finish_reason is None]
    return [GenerateOutput(r.output_ids, r.finish_reason or "length", len(r.input_ids)) for r in reqs]


def _step(runner: ModelRunner, reqs: list[_Running], mode: ForwardMode, eos: set[int]) -> None:
    req_table = runner.req_to_token_pool.req_to_token
    if mode is ForwardMode.EXTEND:
        for r in reqs:
            row = runner.req_to_token_pool.alloc()
            if row is None:
                raise RuntimeError("out of request slots")
            r.row = row
        prefix_lens = [0] * len(reqs)
        seq_lens = [len(r.input_ids) for r in reqs]
        input_ids = [t for r in reqs for t in r.input_ids]
    else:
        seq_lens = [r.seq_len for r in reqs]
        prefix_lens = [s - 1 for s in seq_lens]
        input_ids = [r.output_ids[-1] for r in reqs]
    rows = [r.row for r in reqs]
    out_cache_loc = runner.allocator.alloc_extend(req_table, rows, prefix_lens, seq_lens)
    if out_cache_loc is None:
        raise RuntimeError(f"KV cache exhausted ({runner.max_total_tokens} tokens); raise --max-total-tokens")
    batch = make_forward_batch(mode, input_ids, rows, prefix_lens, seq_lens, out_cache_loc, runner.device)
    logits = runner.forward(batch)
    info = SamplingBatchInfo.from_lists(
        temperatures=[r.params.temperature for r in reqs], top_ps=[r.params.top_p for r in reqs],
        top_ks=[r.params.top_k for r in reqs], min_ps=[r.params.min_p for r in reqs],
        seeds=[r.seed for r in reqs], output_positions=[len(r.output_ids) for r in reqs], device=runner.device)
    penalized = apply_penalties(logits, [r.params.penalties for r in reqs], [r.output_ids for r in reqs],
                                [r.input_ids for r in reqs])
    penalized = apply_logit_bias(penalized, [r.params.logit_bias for r in reqs])
    penalized = ban_tokens(penalized, [r.params.banned_ids(len(r.output_ids), eos) for r in reqs])
    next_ids = runner.sample(penalized, info).tolist()
    for r, token in zip(reqs, next_ids):
        r.output_ids.append(int(token))
        if len(r.output_ids) < r.params.min_new_tokens:
            continue  # max_new_tokens >= min_new_tokens: nothing ends it yet
        if (token in eos and not r.params.ignore_eos) or token in r.params.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.output_ids) >= r.params.max_new_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            # The last sampled token never entered the pool: free exactly the tokens written.
            runner.allocator.free_slots(req_table[r.row, : r.seq_len - 1])
            runner.req_to_token_pool.free(r.row)


class Engine:
    """`Engine(model_path=None, tp_size=1, dtype="auto").generate(prompts, params)`.

    model_path None means the bundled SmolLM2-135M-Instruct.
    """

    def __init__(self, model_path: str | None = None, *, tp_size: int = 1, dtype: str = "auto",
                 device: str = "cpu", page_size: int = 1, max_total_tokens: int | None = None,
                 mem_fraction_static: float | None = None, max_running_requests: int = 256, random_seed: int = 0,
                 max_prefill_tokens: int = 4096, context_length: int | None = None,
                 start_timeout_s: float = 300.0, quantization: str | None = None) -> None:
        self.model_dir = resolve_model_path(model_path)
        self.tp_size = tp_size
        self.random_seed = random_seed
        self.max_prefill_tokens = max_prefill_tokens
        self._requests_seen = 0
        self.config = RunnerConfig(model_dir=self.model_dir, dtype=resolve_dtype(dtype, device), device=device,
                                   page_size=page_size, mem_fraction_static=mem_fraction_static,
                                   max_total_tokens=max_total_tokens, max_running_requests=max_running_requests,
                                   context_length=context_length, local_world_size=tp_size,
                                   quantization=quantization)
        self.runner: ModelRunner | None = None
        self._procs: list[Any] = []
        if tp_size == 1:
            self.runner = ModelRunner(self.config)
            return
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._conn, child_conn = ctx.Pipe()
        for rank in range(tp_size):
            proc = ctx.Process(target=_rank_main, args=(rank, tp_size, init_method, self.config,
                                                        child_conn if rank == 0 else None), daemon=True)
            proc.start()
            self._procs.append(proc)
        child_conn.close()  # rank 0 holds the other end: its exit ends the pipe
        status = self._reply("during start-up", start_timeout_s)
        if status[0] != "ready":
            self.shutdown()
            raise RuntimeError(f"rank start-up failed: {status[1]}")
        self.runner_info: dict[str, Any] = status[1]

    def _reply(self, during: str, timeout_s: float | None = None) -> Any:
        """Rank 0's next message, watching every rank meanwhile: a rank that exits first (or no
        message within `timeout_s`) shuts the others down and raises, naming it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                if self._conn.poll(POLL_S):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass  # rank 0 is gone: its exit code below
            dead = self._dead_ranks()
            if dead:
                self.shutdown()
                why = f"tensor-parallel {_describe(dead)} {during}"
                if any(code > 0 for _, code in dead):
                    why += f" (its traceback is in the log above{SPAWN_HINT if during == 'during start-up' else ''})"
                raise RuntimeError(why)
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"tensor-parallel ranks did not start within {timeout_s} s")

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[GenerateOutput]:
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        constrained = next((p.grammar.kind for p in plist if p.grammar is not None), None)
        if constrained is not None:
            raise ValueError(f"{constrained}: the offline Engine does not constrain outputs; serve the model")
        seeds = [p.seed if p.seed is not None else self.random_seed * 1_000_003 + self._requests_seen + i
                 for i, p in enumerate(plist)]
        self._requests_seen += len(prompts)
        if self.runner is not None:
            return run_generation(self.runner, prompts, plist, seeds, self.max_prefill_tokens)
        if not self._procs:
            raise RuntimeError("the engine is shut down")
        try:
            self._conn.send(("generate", (prompts, plist, seeds, self.max_prefill_tokens)))
        except OSError:  # rank 0 is gone (BrokenPipeError): _reply names it
            pass
        kind, payload = self._reply("during generation")
        if kind != "ok":
            dead = self._dead_ranks()
            if dead:  # a lost rank breaks the group: the engine cannot go on
                self.shutdown()
            raise RuntimeError(f"generation failed on a rank{' (' + _describe(dead) + ')' if dead else ''}: {payload}")
        return payload

    def _dead_ranks(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the ranks that have exited, those a signal ended first (the rank
        lost first, the others fail after it)."""
        dead = [(rank, proc.exitcode) for rank, proc in enumerate(self._procs) if proc.exitcode is not None]
        return sorted(dead, key=lambda d: (d[1] >= 0, d[0]))

    def shutdown(self) -> None:
        if self._procs:
            try:
                self._conn.send(("shutdown", None))
            except (BrokenPipeError, OSError):
                pass
            for proc in self._procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            self._procs = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


POLL_S = 0.2  # how often a waiting Engine checks that its ranks are alive
SPAWN_HINT = ("; if it says that a new process started before the current one finished bootstrapping: ranks "
              "start by multiprocessing's spawn, which imports the main module again, so a script must create an "
              "Engine with tp_size > 1 under `if __name__ == \"__main__\":`")


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


def _rank_main(rank: int, tp_size: int, init_method: str, config: RunnerConfig, conn: Connection | None) -> None:
    torch.set_num_threads(threads_per_rank(tp_size))
    try:
        state = init_distributed(tp_size=tp_size, pp_size=1, world_rank=rank, init_method=init_method,
                                 device=torch.device(config.device))
        runner = ModelRunner(config, state)
    except Exception:
        if conn is not None:
            conn.send(("error", traceback.format_exc()))
        raise
    if conn is not None:
        conn.send(("ready", runner.info()))
    while True:
        command = conn.recv() if conn is not None else None
        message: Any = state.tp.broadcast_pyobj(command)
        kind, payload = message
        if kind == "shutdown":
            break
        try:
            result: Any = run_generation(runner, *payload)
            reply = ("ok", result)
        except Exception:
            reply = ("error", traceback.format_exc())
        if conn is not None:
            conn.send(reply)
    destroy_distributed()
