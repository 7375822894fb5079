"""Latency of one static batch, without a server (SGLang's bench_one_batch on srt's ModelRunner).

    python scripts/bench_one_batch.py --batch-size 1 32 --input-len 128 --output-len 32 \\
        [--tp-size N] [--model-path P] [--dtype D] [--quantization w8a8_int8] [--compare-transformers]
        [--compare-llama-cpp [GGUF]] [--compare-deterministic]
        [--warmup N] [--runs N] [--json PATH]

For each batch size: seeded random prompts of `input_len` tokens, one extend step for the whole
batch, then `output_len` greedy decode steps. Only forward + sample are timed. With --tp-size > 1
every rank runs the same steps (the all-reduces keep them in lockstep) and rank 0 reports.

Each batch size is warmed up, then timed `--runs` times; the best run counts (as timeit does), since
load from other processes only ever adds time. At tp 1 the srt and transformers runs alternate, so
such load falls on both alike.

--compare-transformers times `generate` of transformers on the same checkpoint and dtype in the same
run. Its prefill is one forward on the batch; its decode time is generate minus that prefill, over
the same `output_len` decode steps (so generate makes output_len + 1 new tokens, as srt does).

--compare-llama-cpp times llama.cpp (llama-cpp-python, if installed; `pip install llama-cpp-python`
builds it; on a VM whose CPU reports AMX the default native build may die with SIGILL: build with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF") on a GGUF file (default: the bundled SmolLM2 GGUF, Q4_1) with the same threads, for
batch 1: the prompt evaluated in one call, then `output_len` greedy single-token steps. Its
weights are 4-bit there, so its decode reads a third of srt's bf16 bytes.

--compare-deterministic (tp 1) times a second runner with --enable-deterministic-inference (every
prompt token on the decode attention kernel, no fused decode layers) on the same prompts, its runs
alternating with the default's, and prints the ratios.

At tp 1 the script also prints the prefill compute bound: the machine's bf16 matmul rate (a
square matmul with torch's threads, best of 5, 2048 wide unless that would take long) over 2 x (parameters outside the embedding and
LM head) FLOPs per prompt token, and the share of it srt's best prefill reaches.

--device cuda runs srt on the GPU (with --attention-backend and --disable-cuda-graph as
launch_server takes them; tp 1, no peers): the floor is then the device's read bandwidth (a 2 GiB
sum on the GPU, timed between srt's runs) and the matmul rate the GPU's; every step's ids come
back to the host, so each step is timed to its end.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench this checkout, installed or not

import torch  # noqa: E402

from model_executor.cpu.kernels.packing import (  # noqa: E402
    Q6K_BLOCK_BYTES,
    Q6KS_BLOCK_BYTES,
    Int8Weight,
    Q4KWeight,
    Q4Weight,
    Q5KWeight,
    SplitWeight,
)
from model_executor.cpu.linear import set_one_arithmetic  # noqa: E402
from model_executor.cpu.weights import QUANTIZATIONS  # noqa: E402
from model_executor.distributed.parallel_state import destroy_distributed, init_distributed  # noqa: E402
from model_executor.forward_batch import ForwardMode, make_forward_batch  # noqa: E402
from model_executor.layers.linear import LinearBase  # noqa: E402
from model_executor.layers.moe import SparseMoeBlock  # noqa: E402
from model_executor.loader.model_path import resolve_model_path  # noqa: E402
from model_executor.loader.weight_source import load_hf_config  # noqa: E402
from model_executor.model_runner import ModelRunner, RunnerConfig, model_weight_bytes  # noqa: E402
from model_executor.sampling_inputs import SamplingInputs  # noqa: E402
from srt.utils import free_port, resolve_dtype, threads_per_rank  # noqa: E402


@dataclass(frozen=True)
class BenchSpec:
    batch_sizes: tuple[int, ...]
    input_len: int
    output_len: int
    warmup: int  # untimed full-length runs per batch size: a cold process runs several times slower
    runs: int  # timed runs per batch size; the best counts
    seed: int


Timing = tuple[float, float]  # one run: (prefill s, decode s per step)


@dataclass(frozen=True)
class BatchResult:
    batch_size: int
    input_len: int
    prefill_s: float
    decode_step_s: float  # of the best run; srt: median step, transformers: mean (generate is one call)

    @property
    def prefill_tok_s(self) -> float:
        return self.batch_size * self.input_len / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        return self.batch_size / self.decode_step_s

    def to_json(self) -> dict[str, float]:
        return {
            **asdict(self),
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "decode_ms_per_step": self.decode_step_s * 1e3,
        }


def make_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + batch_size)
    return torch.randint(0, vocab_size, (batch_size, input_len), generator=generator).tolist()


# ---- srt -------------------------------------------------------------------------------------


def run_batch(runner: ModelRunner, prompts: list[list[int]], decode_steps: int) -> tuple[float, list[float]]:
    """One extend step and `decode_steps` greedy decode steps; returns (prefill s, per-step s).

    Leaves the request rows and KV slots free again."""
    bs, input_len = len(prompts), len(prompts[0])
    pool, device = runner.req_to_token_pool, runner.device
    rows = [pool.alloc() for _ in prompts]
    if any(row is None for row in rows):
        raise RuntimeError(f"batch {bs} exceeds the {pool.size} request slots")
    rows_ok = [int(row) for row in rows if row is not None]
    greedy = SamplingInputs.greedy(bs)

    def step(
        mode: ForwardMode, input_ids: list[int], prefix_len: int, seq_len: int
    ) -> tuple[float, list[int]]:
        prefix_lens, seq_lens = [prefix_len] * bs, [seq_len] * bs
        out_cache_loc = runner.memory.alloc_extend(rows_ok, prefix_lens, seq_lens)
        if out_cache_loc is None:
            raise RuntimeError(f"KV cache exhausted ({runner.max_total_tokens} tokens)")
        batch = make_forward_batch(mode, input_ids, rows_ok, prefix_lens, seq_lens, out_cache_loc, device)
        start = time.perf_counter()
        out = runner.step(batch, greedy)
        elapsed = time.perf_counter() - start
        assert out is not None, "one pipeline stage"
        return elapsed, out.next_ids

    prefill_s, next_ids = step(ForwardMode.EXTEND, [t for p in prompts for t in p], 0, input_len)
    step_s = []
    for i in range(decode_steps):
        seq_len = input_len + i + 1
        elapsed, next_ids = step(ForwardMode.DECODE, next_ids, seq_len - 1, seq_len)
        step_s.append(elapsed)
    for row in rows_ok:
        runner.memory.free_slots(pool.req_to_token[row, : input_len + decode_steps])
        pool.free(row)
    return prefill_s, step_s


def srt_timer(runner: ModelRunner, spec: BenchSpec, bs: int) -> Callable[[], Timing]:
    prompts = make_prompts(bs, spec.input_len, runner.vocab_size, spec.seed)

    def once() -> Timing:
        prefill_s, step_s = run_batch(runner, prompts, spec.output_len)
        return prefill_s, statistics.median(step_s)

    return once


def switched(timer: Callable[[], Timing], one_arithmetic: bool) -> Callable[[], Timing]:
    """`timer` with the process's linear-layer choice for its runner (two runners share a process)."""

    def once() -> Timing:
        set_one_arithmetic(one_arithmetic)
        return timer()

    return once


def measure(timers: list[Callable[[], Timing]], spec: BenchSpec, bs: int) -> list[BatchResult]:
    """Warms each timer up, then calls them in turn `spec.runs` times; the best run of each."""
    for timer in timers:
        for _ in range(spec.warmup):
            timer()
    timings: list[list[Timing]] = [[] for _ in timers]
    for _ in range(spec.runs):
        for timer, runs in zip(timers, timings):
            runs.append(timer())
    return [
        BatchResult(bs, spec.input_len, min(p for p, _ in runs), min(d for _, d in runs)) for runs in timings
    ]


def bench_srt(runner: ModelRunner, spec: BenchSpec) -> list[BatchResult]:
    return [measure([srt_timer(runner, spec, bs)], spec, bs)[0] for bs in spec.batch_sizes]


def _bench_rank_main(
    rank: int, tp_size: int, init_method: str, config: RunnerConfig, spec: BenchSpec, conn: Connection | None
) -> None:
    torch.set_num_threads(threads_per_rank(tp_size))
    try:
        state = init_distributed(
            tp_size=tp_size,
            pp_size=1,
            world_rank=rank,
            init_method=init_method,
            device=torch.device(config.device),
        )
        reply: tuple[str, Any] = ("ok", bench_srt(ModelRunner(config, state), spec))
    except Exception:
        reply = ("error", f"rank {rank}: {traceback.format_exc()}")
    if conn is not None:
        conn.send(reply)
    destroy_distributed()


def bench_srt_tp(
    config: RunnerConfig,
    spec: BenchSpec,
    tp_size: int,
    timeout_s: float = 3600.0,
) -> list[BatchResult]:
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    parent_conn, child_conn = ctx.Pipe()
    procs = [
        ctx.Process(
            target=_bench_rank_main,
            daemon=True,
            args=(rank, tp_size, init_method, config, spec, child_conn if rank == 0 else None),
        )
        for rank in range(tp_size)
    ]
    for proc in procs:
        proc.start()
    try:
        if not parent_conn.poll(timeout_s):
            raise RuntimeError(f"tensor-parallel benchmark gave no result within {timeout_s} s")
        kind, payload = parent_conn.recv()
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if kind != "ok":
        raise RuntimeError(f"tensor-parallel benchmark failed on {payload}")
    return payload


# ---- transformers ------------------------------------------------------------------------------


def load_transformers(model_dir: Path, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


def transformers_timer(model: Any, spec: BenchSpec, bs: int) -> Callable[[], Timing]:
    prompts = make_prompts(bs, spec.input_len, int(model.config.vocab_size), spec.seed)
    # Equal-length prompts need no padding; the mask is the one a left-padded batch would pass.
    input_ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)
    device = str(model.device)
    attention_mask = torch.ones_like(input_ids)
    new_tokens = spec.output_len + 1  # the prefill's token, then output_len decode steps
    eos = model.generation_config.eos_token_id
    pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    @torch.inference_mode()
    def once() -> Timing:
        _sync(device)
        start = time.perf_counter()
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
        _sync(device)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            use_cache=True,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        _sync(device)
        generate_s = time.perf_counter() - start
        assert out.shape == (bs, spec.input_len + new_tokens), out.shape
        return prefill_s, max(generate_s - prefill_s, 1e-9) / spec.output_len

    return once


# ---- llama.cpp -----------------------------------------------------------------------------------


def load_llama_cpp(gguf: str, context: int, threads: int) -> Any:
    try:
        from llama_cpp import Llama
    except ImportError as error:
        raise SystemExit(
            f"--compare-llama-cpp needs llama-cpp-python ({error}): pip install llama-cpp-python"
        ) from None
    return Llama(
        model_path=gguf,
        n_ctx=context,
        n_batch=context,
        n_ubatch=context,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def llama_cpp_timer(llm: Any, spec: BenchSpec) -> Callable[[], Timing]:
    """Batch 1: the prompt in one eval, then output_len greedy steps of one token each."""
    import numpy as np

    prompt = make_prompts(1, spec.input_len, int(llm.n_vocab()), spec.seed)[0]

    def once() -> Timing:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(spec.output_len):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return prefill_s, (time.perf_counter() - start) / spec.output_len

    return once


# ---- the machine's limit ---------------------------------------------------------------------


PROBE_BYTES = 512 * 2**20  # more than the machine's L3
GPU_PROBE_BYTES = 2 * 2**30  # far more than a GPU's L2, and long past a launch's overhead


def probe_bytes(device: str) -> int:
    return GPU_PROBE_BYTES if torch.device(device).type == "cuda" else PROBE_BYTES


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_timer(num_bytes: int = PROBE_BYTES, device: str = "cpu") -> Callable[[], Timing]:
    """A streaming fp32 sum over `num_bytes`, the rate at which a batch-1 decode step can at best
    read its weights, as a timer (its seconds twice) that `measure` runs in turn with srt's batch-1
    runs: on a shared machine the read bandwidth moves from minute to minute, so the floor is taken
    in the same minutes as the step it is compared with."""
    data = torch.ones(num_bytes // 4, device=device)

    def once() -> Timing:
        _sync(device)
        start = time.perf_counter()
        data.sum()
        _sync(device)
        elapsed = time.perf_counter() - start
        return elapsed, elapsed

    return once


def _matmul_rate(
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], a: torch.Tensor, b: torch.Tensor, runs: int
) -> float:
    """(Multiply-add counted as two) operations per second of `matmul(a, b)` for square a and b,
    after one untimed call (best run)."""
    device = str(a.device)
    matmul(a, b)
    best = float("inf")
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        matmul(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * a.shape[0] ** 3 / best


PROBE_SIZES = (256, 512, 1024, 2048)
GPU_PROBE_SIZE = 8192  # a GPU's rate needs a large product
PROBE_RUN_S = 0.25  # a probe grows to the largest size whose one call stays under this


def _probe_rate(
    make: Callable[[int], torch.Tensor],
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    runs: int,
) -> float:
    """The rate at the largest of PROBE_SIZES (up to 2048) whose call took under PROBE_RUN_S at the
    size before: a CPU where torch has no fast kernel for the dtype (bf16 without AVX-512 BF16 or
    AMX is far slower than fp32: docs/performance.md) is measured in seconds instead of minutes."""
    rate = 0.0
    for size in PROBE_SIZES:
        a, b = make(size), make(size)
        start = time.perf_counter()
        matmul(a, b)
        if time.perf_counter() - start > PROBE_RUN_S and rate:
            break
        rate = _matmul_rate(matmul, a, b, runs)
    return rate


def matmul_flops(runs: int = 5, device: str = "cpu") -> float:
    """FLOP/s of a bf16 square matmul (up to 2048; on a GPU 8192) with torch's threads (best run)."""
    if torch.device(device).type == "cuda":
        a, b = (
            torch.randn(GPU_PROBE_SIZE, GPU_PROBE_SIZE, dtype=torch.bfloat16, device=device) for _ in "ab"
        )
        return _matmul_rate(torch.matmul, a, b, runs)
    return _probe_rate(lambda n: torch.randn(n, n, dtype=torch.bfloat16), torch.matmul, runs)


def int8_matmul_ops(runs: int = 5) -> float | None:
    """OP/s of torch's int8 x int8 -> int32 matmul (`torch._int_mm`, oneDNN), square up to 2048,
    with torch's threads (best run): the multiply rate a --quantization w8a8_int8 prefill's linears
    can at best reach. None where torch has none."""
    try:
        return _probe_rate(lambda n: torch.randint(-127, 128, (n, n), dtype=torch.int8), torch._int_mm, runs)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def compute_bound_line(
    num_params: int, rate: float, prefill_tok_s: float, probe: str = "bf16 matmul", unit: str = "GFLOP/s"
) -> str:
    bound = rate / (2 * num_params)
    return (
        f"prefill compute bound: {bound:.0f} tok/s ({2 * num_params / 1e6:.0f} MFLOP/token at "
        f"{rate / 1e9:.0f} {unit} measured {probe}); srt prefill at {prefill_tok_s / bound * 100:.0f}% of it"
    )


def packed_read_bytes(packed: object) -> int:
    """Bytes a one-row product reads of a packed weight: a GGUF weight's blocks (not a bf16 copy),
    an int8 weight and its scales, a bf16 layout."""
    if isinstance(packed, torch.Tensor):
        return packed.numel() * packed.element_size()
    if isinstance(packed, Int8Weight):
        return packed.packed.numel() + packed.scale.numel() * 4
    if isinstance(packed, SplitWeight):
        return sum(packed_read_bytes(part) for part in packed.parts)
    return int(packed.packed.numel())  # type: ignore[attr-defined]


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every parameter in memory once, each linear
    layer packed for the kernels at what its one-row product reads (packed_read_bytes) instead of
    its weight as loaded."""
    replaced: set[int] = set()
    total = 0
    for module in model.modules():
        packed = getattr(module, "packed_weight", None) if isinstance(module, LinearBase) else None
        if packed is not None:
            replaced.add(id(module.weight))
            total += packed_read_bytes(packed)
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in replaced and id(p) not in seen and p.device.type != "meta":
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def weight_kind(packed: object) -> str:
    """What a layer's one-row product runs on: its GGUF block type, int8 or bf16."""
    if packed is None or isinstance(packed, torch.Tensor):
        return "bf16"
    if isinstance(packed, Int8Weight):
        return "int8"
    if isinstance(packed, SplitWeight):
        return "+".join(weight_kind(part) for part in packed.parts)
    name = {Q4Weight: "Q4_1", Q4KWeight: "Q4_K", Q5KWeight: "Q5_K"}.get(type(packed))
    if name is None:
        six = packed.packed.shape[-1] in (Q6K_BLOCK_BYTES, Q6KS_BLOCK_BYTES)  # type: ignore[attr-defined]
        name = "Q6_K" if six else "Q8_0/Q5_0/Q4_0"
    return name


def weight_breakdown(
    model: torch.nn.Module, bandwidth: float, runs: int = 7
) -> tuple[str, list[dict[str, Any]]]:
    """Per kind of linear weight (its role, q/k/v or gate/up merged, and what it runs on): how many,
    the bytes a one-row product reads, the time of those products one after another (op by op, the
    kernels the fused layer calls; median of `runs`), and the bandwidth floor's share of that time."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            key = (name.rsplit(".", 1)[-1], weight_kind(getattr(module, "packed_weight", None)))
            groups.setdefault(key, []).append(module)
    rows: list[dict[str, Any]] = []
    for (role, kind), modules in sorted(groups.items()):
        xs = [torch.randn(1, m.weight.shape[1]).bfloat16() for m in modules]

        def run(modules: list[Any] = modules, xs: list[torch.Tensor] = xs) -> None:
            for module, x in zip(modules, xs):
                module.linear_method.apply(module, x, getattr(module, "bias", None))

        run()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        nbytes = sum(
            packed_read_bytes(m.packed_weight) if m.packed_weight is not None else m.weight.numel() * 2
            for m in modules
        )
        rows.append(
            {"weight": role, "kind": kind, "count": len(modules), "bytes": nbytes, "seconds": seconds}
        )
    header = f"{'weight':>14} | {'runs on':>14} | {'count':>5} | {'MB':>8} | {'ms':>7} | {'GB/s':>6} | {'floor share':>11}"
    lines = ["batch-1 linears by kind (op by op, one row)", header, "-" * len(header)]
    for r in rows + [
        {
            "weight": "all",
            "kind": "",
            "count": sum(r["count"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows),
            "seconds": sum(r["seconds"] for r in rows),
        }
    ]:
        rate = r["bytes"] / r["seconds"]
        lines.append(
            f"{r['weight']:>14} | {r['kind']:>14} | {r['count']:>5} | {r['bytes'] / 1e6:>8.1f} | "
            f"{r['seconds'] * 1e3:>7.2f} | {rate / 1e9:>6.1f} | {rate / bandwidth * 100:>10.0f}%"
        )
    return "\n".join(lines), rows


def unread_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the weights a batch-1 decode step does not read, how many of them are experts'
    parameters): in each mixture-of-experts layer all but num_experts_per_tok of its experts (every
    expert the same size), and an untied token embedding (a step reads one row of it)."""
    unread_bytes = expert_params = 0
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            unread = module.num_experts - module.top_k
            expert_params += unread * sum(p.numel() for p in module.experts[0].parameters())
            unread_bytes += unread * model_weight_bytes(module.experts[0])
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if embed is not None and head is not None and head.weight is not embed.weight:
        unread_bytes += embed.weight.numel() * embed.weight.element_size()
    return unread_bytes, expert_params


def roofline_line(weight_bytes: int, bandwidth: float, decode_step_s: float, moe: bool = False) -> str:
    floor_s = weight_bytes / bandwidth
    what = (
        "active-weight floor (batch 1 decode: attention, router and top-k experts)"
        if moe
        else ("weight-bandwidth floor (batch 1 decode)")
    )
    return (
        f"{what}: {floor_s * 1e3:.2f} ms/step = {1 / floor_s:.0f} steps/s "
        f"({weight_bytes / 1e6:.0f} MB of weights at {bandwidth / 1e9:.1f} GB/s, the read bandwidth measured between srt's runs); "
        f"srt batch-1 decode at {floor_s / decode_step_s * 100:.0f}% of it"
    )


# ---- report ------------------------------------------------------------------------------------


def format_table(title: str, results: list[BatchResult], step_stat: str) -> str:
    header = f"{'batch size':>10} | {'prefill tok/s':>13} | {'decode tok/s':>12} | {f'decode ms/step ({step_stat})':>23}"
    lines = [title, header, "-" * len(header)]
    lines += [
        f"{r.batch_size:>10} | {r.prefill_tok_s:>13.1f} | {r.decode_tok_s:>12.1f} | "
        f"{r.decode_step_s * 1e3:>23.2f}"
        for r in results
    ]
    return "\n".join(lines)


def ratios(srt: list[BatchResult], hf: list[BatchResult]) -> list[dict[str, float]]:
    return [
        {
            "batch_size": s.batch_size,
            "prefill": s.prefill_tok_s / h.prefill_tok_s,
            "decode": s.decode_tok_s / h.decode_tok_s,
        }
        for s, h in zip(srt, hf)
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--model-path", default=None, help="HF directory or .gguf; default: bundled SmolLM2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="srt's weights (and activations) in int8, as launch_server --quantization",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per batch size")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per batch size; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-transformers", action="store_true")
    parser.add_argument(
        "--compare-llama-cpp",
        nargs="?",
        const="",
        default=None,
        metavar="GGUF",
        help="also time llama.cpp at batch 1 (default GGUF: the bundled SmolLM2)",
    )
    parser.add_argument(
        "--compare-deterministic",
        action="store_true",
        help="also time --enable-deterministic-inference, alternating with the default (tp 1)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--attention-backend", default="auto", help="as launch_server's (default: auto)")
    parser.add_argument(
        "--disable-cuda-graph", action="store_true", help="with --device cuda: decode eagerly"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("input_len", "output_len", "tp_size", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batch_size) < 1:
        parser.error(f"--batch-size values must be >= 1, got {args.batch_size}")
    if args.compare_deterministic and args.tp_size != 1:
        parser.error("--compare-deterministic runs at --tp-size 1")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.device == "cuda" and (
        args.tp_size != 1
        or args.compare_llama_cpp is not None
        or args.compare_deterministic
        or args.quantization
    ):
        parser.error(
            "--device cuda runs at --tp-size 1, without --compare-llama-cpp, --compare-deterministic or --quantization"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model_path(args.model_path)
    dtype = resolve_dtype(args.dtype, args.device)
    dtype_name = str(dtype).removeprefix("torch.")
    context_length = int(getattr(load_hf_config(model_dir), "max_position_embeddings", 0) or 4096)
    if args.input_len + args.output_len > context_length:
        raise ValueError(
            f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds the "
            f"model's context length ({context_length})"
        )
    spec = BenchSpec(
        tuple(args.batch_size), args.input_len, args.output_len, args.warmup, args.runs, args.seed
    )
    max_bs = max(spec.batch_sizes)
    config = RunnerConfig(
        model_dir=model_dir,
        dtype=dtype,
        max_running_requests=max_bs,
        max_total_tokens=max_bs * (args.input_len + args.output_len),
        local_world_size=args.tp_size if args.device == "cpu" else 1,  # a GPU each
        quantization=args.quantization,
        device=args.device,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
    )
    hf: list[BatchResult] = []
    llama: list[BatchResult] = []
    det: list[BatchResult] = []
    weight_bytes = num_params = 0
    bandwidth = 0.0  # bytes/s, measured with the batch-1 runs
    llm = None
    if args.compare_llama_cpp is not None:
        from srt.default_model import default_model_path

        gguf = args.compare_llama_cpp or default_model_path()
        llm = load_llama_cpp(gguf, args.input_len + args.output_len + 8, torch.get_num_threads())
    if args.tp_size == 1:
        runner = ModelRunner(config)
        unread_bytes, unread_expert_params = unread_weights(runner.model)
        weight_bytes = streamed_weight_bytes(runner.model) - unread_bytes
        moe = unread_expert_params > 0
        # A prompt token runs every layer (a MoE layer: its top-k experts); the LM head only the last token of each prompt.
        num_params = (
            sum(
                p.numel()
                for name, p in runner.model.named_parameters()
                if "embed_tokens" not in name and "lm_head" not in name
            )
            - unread_expert_params
        )
        hf_model = load_transformers(model_dir, dtype, args.device) if args.compare_transformers else None
        det_runner = ModelRunner(replace(config, deterministic=True)) if args.compare_deterministic else None
        srt = []
        for bs in spec.batch_sizes:
            timers = [switched(srt_timer(runner, spec, bs), False)]
            if det_runner is not None:
                timers.append(switched(srt_timer(det_runner, spec, bs), True))
            if hf_model is not None:
                timers.append(transformers_timer(hf_model, spec, bs))
            if llm is not None and bs == 1:
                timers.append(llama_cpp_timer(llm, spec))
            if bs == 1:
                timers.append(bandwidth_timer(probe_bytes(args.device), args.device))
            results = measure(timers, spec, bs)
            if bs == 1:
                bandwidth = probe_bytes(args.device) / results.pop().prefill_s  # the best of its runs
            srt.append(results.pop(0))
            det += [results.pop(0)] if det_runner is not None else []
            hf += results[:1] if hf_model is not None else []
            llama += results[-1:] if llm is not None and bs == 1 else []
    else:
        srt = bench_srt_tp(config, spec, args.tp_size)
        if args.compare_transformers:
            hf_model = load_transformers(model_dir, dtype)
            hf = [measure([transformers_timer(hf_model, spec, bs)], spec, bs)[0] for bs in spec.batch_sizes]
        if llm is not None and 1 in spec.batch_sizes:
            llama = [measure([llama_cpp_timer(llm, spec)], spec, 1)[0]]

    print(
        f"model {model_dir}, dtype {dtype_name}{', ' + args.quantization if args.quantization else ''}, input {args.input_len}, output {args.output_len}, "
        f"torch threads {torch.get_num_threads() if args.tp_size == 1 else threads_per_rank(args.tp_size)}"
        f"{'' if args.tp_size == 1 else ' per rank'}; best of {args.runs} runs after {args.warmup} warmup"
    )
    print(format_table(f"srt (tp={args.tp_size})", srt, "median"))
    report: dict[str, Any] = {
        "model_dir": str(model_dir),
        "dtype": dtype_name,
        "quantization": args.quantization,
        "tp_size": args.tp_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "warmup": args.warmup,
        "runs": args.runs,
        "srt": [r.to_json() for r in srt],
    }
    batch_1 = next((r for r in srt if r.batch_size == 1), None)
    if weight_bytes and batch_1 is not None:
        print(roofline_line(weight_bytes, bandwidth, batch_1.decode_step_s, moe=moe))
        report["read_bandwidth_bytes_per_s"] = bandwidth
        report["weight_bytes"] = weight_bytes
        if args.device == "cpu":
            table, report["weight_breakdown"] = weight_breakdown(runner.model, bandwidth)
            print(table)
    if num_params:
        flops = matmul_flops(device=args.device)
        best_prefill = max(r.prefill_tok_s for r in srt)
        report["matmul_flops"] = flops
        int8_ops = int8_matmul_ops() if args.quantization == "w8a8_int8" else None
        if int8_ops is not None:  # the linears multiply in int8: the bound is int8's rate
            report["int8_matmul_ops"] = int8_ops
            print(compute_bound_line(num_params, int8_ops, best_prefill, "int8 matmul", "GOP/s"))
        else:
            print(compute_bound_line(num_params, flops, best_prefill))
        report["prefill_compute_bound_tok_s"] = (flops if int8_ops is None else int8_ops) / (2 * num_params)
    if det:
        print(format_table("srt --enable-deterministic-inference", det, "median"))
        report["deterministic"] = [r.to_json() for r in det]
        report["ratios_deterministic"] = ratios(det, srt)
        for ratio in report["ratios_deterministic"]:
            print(
                f"deterministic / default (batch {ratio['batch_size']}): prefill {ratio['prefill']:.2f}x, "
                f"decode {ratio['decode']:.2f}x"
            )
    if args.compare_transformers:
        print(format_table("transformers generate", hf, "mean"))
        report["transformers"] = [r.to_json() for r in hf]
        report["ratios"] = ratios(srt, hf)
        for ratio in report["ratios"]:
            print(f"ratio vs transformers (batch {ratio['batch_size']} prefill): {ratio['prefill']:.2f}x")
            print(f"ratio vs transformers (batch {ratio['batch_size']} decode): {ratio['decode']:.2f}x")
    if llm is not None:
        if not llama:
            print("llama.cpp: timed at batch 1 only (add 1 to --batch-size)")
        else:
            print(format_table("llama.cpp (batch 1)", llama, "mean"))
            report["llama_cpp"] = [r.to_json() for r in llama]
            srt_1 = next(r for r in srt if r.batch_size == 1)
            report["ratios_llama_cpp"] = ratios([srt_1], llama)
            for ratio in report["ratios_llama_cpp"]:
                print(f"ratio vs llama.cpp (batch 1 prefill): {ratio['prefill']:.2f}x")
                print(f"ratio vs llama.cpp (batch 1 decode): {ratio['decode']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
