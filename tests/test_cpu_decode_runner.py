"""CpuDecodeRunner (model_executor/cpu/decode_runner.py): the decode batches it runs as whole fused
layers and the ones it leaves to the model's layers; the attention backends chosen by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from model_executor.attention.registry import create_attention_backend
from model_executor.attention.torch_native import TorchNativeAttnBackend
from model_executor.cpu import decode_runner as cpu_decode_runner
from model_executor.cpu.attention_backend import CpuKernelsAttnBackend
from model_executor.cpu.decode_runner import CpuDecodeRunner
from model_executor.cpu.kernels import build, ops
from model_executor.cpu.kernels.decode_layers import DecodeLayers
from model_executor.cpu.linear import set_one_arithmetic
from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import PipelineStage
from model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from model_executor.layers.moe import SparseMoeBlock
from model_executor.loader.weight_source import load_hf_config
from model_executor.model_runner import ModelRunner, RunnerConfig
from model_executor.models.registry import get_model_class

# Where the fused layer runs at all: srt_gemv's AVX-512 BF16 loop or weights packed for our kernels.
needs_fused = pytest.mark.skipif(
    build.kernels() is None or not build.bf16_linear_available(),
    reason="no fused decode layer on this CPU (no kernels or no AVX-512 BF16)",
)


def runner_for(model_dir: Path, **kw: object) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, max_total_tokens=512, **kw))  # type: ignore[arg-type]


def prefill(runner: ModelRunner, lens: list[int]) -> list[int]:
    """Prefills one request per length (token ids 3, 4, ...); their request rows."""
    pool = runner.req_to_token_pool
    rows = [int(pool.alloc()) for _ in lens]  # type: ignore[arg-type]
    loc = runner.memory.alloc_extend(rows, [0] * len(rows), lens)
    runner.forward(
        make_forward_batch(
            ForwardMode.EXTEND,
            [3 + i % 300 for n in lens for i in range(n)],
            rows,
            [0] * len(rows),
            lens,
            loc,
        )
    )
    return rows


def decode_step(runner: ModelRunner, rows: list[int], lens: list[int]) -> ForwardBatch:
    """The decode step after prefill(runner, lens): one new token a request, its slot allocated."""
    seqs = [n + 1 for n in lens]
    loc = runner.memory.alloc_extend(rows, lens, seqs)
    return make_forward_batch(ForwardMode.DECODE, [7 + i for i in range(len(rows))], rows, lens, seqs, loc)


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = DecodeLayers.forward
    monkeypatch.setattr(DecodeLayers, "forward", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def record_routes(runner: ModelRunner) -> list[tuple[int, list[list[int]]]]:
    """Each MoE layer's chosen experts as its route_hook receives them, in calls' order."""
    routes: list[tuple[int, list[list[int]]]] = []
    for block in runner.model.modules():
        if isinstance(block, SparseMoeBlock):
            block.route_hook = lambda layer_id, ids: routes.append((layer_id, ids.tolist()))
    return routes


@needs_fused
@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "qwen2",  # a bias on q/k/v, which the fused layer adds
        "qwen3",  # per-head q/k RMSNorm
        "qwen3_moe",  # and a mixture of experts: srt_moe_block inside the fused layer
        "qwen2_moe",  # experts and a gated shared expert
        "mistral_window",  # attention within the last 16 keys (the request of 30 tokens sees 16)
    ],
)
def test_takes_a_bf16_decode_batch_on_one_rank_and_gives_the_layers_logits(
    arch: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model_dir = tiny_model_dirs[arch] if arch in tiny_model_dirs else make_tiny_model(arch, tmp_path / arch)
    runner = runner_for(model_dir)
    assert isinstance(runner.attn_backend, CpuKernelsAttnBackend)  # the default on the CPU
    calls = count_fused_calls(monkeypatch)
    lens = [3, 30]
    rows = prefill(runner, lens)
    batch = decode_step(runner, rows, lens)
    assert runner.step_runner.can_run(batch)
    routes = record_routes(runner)
    fused = runner.forward(batch)
    assert calls == [1]  # one fused call for the whole step (every layer in it)
    fused_routes = routes[:]
    # The same step again, op by op through the model's layers and the attention backend.
    monkeypatch.setattr(runner.step_runner, "can_run", lambda batch: False)
    again = decode_step(runner, rows, lens)
    routes.clear()
    layers = runner.forward(again)
    assert calls == [1]
    # every MoE layer told its route hook the experts it chose, those the layers choose
    assert fused_routes == routes and (len(routes) > 0) == arch.endswith("moe")
    scale = layers.abs().max().item()
    assert (fused - layers).abs().max().item() < 0.02 * scale, (fused - layers).abs().max().item()
    for i in range(runner.model.kv_cache_layout()[0]):  # and it wrote the step's K/V the layers write
        for cache in runner.kv_pool.get_kv_buffer(i):
            torch.testing.assert_close(
                cache[batch.out_cache_loc], cache[again.out_cache_loc], rtol=0.02, atol=0.02
            )


@needs_fused
def test_declines_prefill_and_runs_it_on_the_layers(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runner_for(tiny_model_dirs["llama"])
    calls = count_fused_calls(monkeypatch)
    pool = runner.req_to_token_pool
    rows = [int(pool.alloc())]  # type: ignore[arg-type]
    loc = runner.memory.alloc_extend(rows, [0], [4])
    batch = make_forward_batch(ForwardMode.EXTEND, [5, 6, 7, 8], rows, [0], [4], loc)
    assert not runner.step_runner.can_run(batch)
    assert torch.isfinite(runner.forward(batch)).all()
    assert not calls


@needs_fused
def test_declines_a_decode_batch_above_its_limit(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit is packed_max_rows() with packed weights (AMX: 256 rows), else srt_gemv's 2: set to 2
    here either way, so a 3-request step is too large."""
    monkeypatch.setattr(cpu_decode_runner, "packed_max_rows", lambda: 2)
    runner = runner_for(tiny_model_dirs["llama"])
    calls = count_fused_calls(monkeypatch)
    lens = [3, 30, 7]
    rows = prefill(runner, lens)
    assert runner.step_runner.can_run(decode_step(runner, rows[:2], lens[:2]))
    batch = decode_step(runner, rows, lens)
    assert not runner.step_runner.can_run(batch)
    assert torch.isfinite(runner.forward(batch)).all()
    assert not calls


@needs_fused
def test_declines_every_step_in_deterministic_mode(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """There every step runs the layers a prefill runs (the fused layer's arithmetic is its own)."""
    try:
        runner = runner_for(tiny_model_dirs["llama"], deterministic=True)
        assert (
            isinstance(runner.attn_backend, CpuKernelsAttnBackend) and runner.attn_backend.decode_rows_extend
        )
        calls = count_fused_calls(monkeypatch)
        rows = prefill(runner, [3])
        batch = decode_step(runner, rows, [3])
        assert not runner.step_runner.can_run(batch)
        runner.forward(batch)
        assert not calls
    finally:
        set_one_arithmetic(False)


@pytest.mark.parametrize(
    ("arch", "dtype", "backend"),
    [
        ("llama", torch.float32, "auto"),  # an fp32 pool: the kernels are bf16
        ("olmoe", torch.bfloat16, "auto"),  # q/k norms across heads: not the fused layer's block
        ("llama", torch.bfloat16, "torch_native"),  # the fused layer's attention is our kernel's
    ],
)
def test_declines_what_the_fused_layer_does_not_compute(
    arch: str,
    dtype: torch.dtype,
    backend: str,
    tiny_model_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    model_dir = tiny_model_dirs[arch] if arch in tiny_model_dirs else make_tiny_model(arch, tmp_path / arch)
    runner = runner_for(model_dir, dtype=dtype, attention_backend=backend)
    calls = count_fused_calls(monkeypatch)
    rows = prefill(runner, [3])
    batch = decode_step(runner, rows, [3])
    assert not runner.step_runner.can_run(batch)
    assert torch.isfinite(runner.forward(batch)).all()
    assert not calls


@needs_fused
def test_declines_tensor_and_pipeline_parallel_ranks(tiny_model_dirs: dict[str, Path]) -> None:
    """srt_decode_layer has no all-reduce and runs a whole model: one rank, one stage."""
    model_dir = tiny_model_dirs["llama"]
    runner = runner_for(model_dir)
    rows = prefill(runner, [3])
    batch = decode_step(runner, rows, [3])
    assert runner.step_runner.can_run(batch)
    for tp_size, pp_size in ((2, 1), (1, 2)):
        other = CpuDecodeRunner(
            runner.model, runner.attn_backend, tp_size=tp_size, pp_size=pp_size, deterministic=False
        )
        assert not other.can_run(batch)
    config = load_hf_config(model_dir)
    for pp_rank in range(2):  # a stage holds no whole decoder stack to run
        stage = PipelineStage.of(config.num_hidden_layers, pp_rank, 2)
        model = get_model_class(config)(config, Communicator.single(), torch.bfloat16, stage)
        assert model.decoder_stack() is None


def test_torch_native_runs_no_cpu_kernel_and_agrees_with_cpu_kernels(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_dirs["llama"]
    lens = [3, 30, 7]
    kernels = runner_for(model_dir)
    with_kernels = kernels.forward(decode_step(kernels, prefill(kernels, lens), lens))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch_native backend called a CPU kernel")

    for name in ("decode_attention", "store_kv", "prefill_attention"):
        monkeypatch.setattr(ops, name, refuse)
    native = runner_for(model_dir, attention_backend="torch_native")
    assert type(native.attn_backend) is TorchNativeAttnBackend
    sdpa = native.forward(decode_step(native, prefill(native, lens), lens))
    scale = sdpa.abs().max().item()
    assert (with_kernels - sdpa).abs().max().item() < 0.02 * scale


def test_the_backend_is_chosen_by_name(tiny_model_dirs: dict[str, Path]) -> None:
    runner = runner_for(tiny_model_dirs["llama"])
    pool, req_to_token = runner.kv_pool, runner.req_to_token_pool.req_to_token
    cpu_device = torch.device("cpu")
    assert (
        type(create_attention_backend("auto", cpu_device, pool, req_to_token, False)) is CpuKernelsAttnBackend
    )
    assert (
        type(create_attention_backend("torch_native", cpu_device, pool, req_to_token, False))
        is TorchNativeAttnBackend
    )
    with pytest.raises(ValueError, match="unknown --attention-backend 'sdpa'"):
        create_attention_backend("sdpa", cpu_device, pool, req_to_token, False)
