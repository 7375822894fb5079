"""The GPU path against transformers on the same weights, and CUDA graphs against eager: CUDA only
(skipped elsewhere; scripts/device_check.sh runs it on a GPU machine).

The model is a tiny random Llama with Llama-3-8B's head size (128) and grouping (4 query heads a
KV head), so every backend's kernels take it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from model_executor.attention.registry import ATTENTION_BACKENDS
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = "cuda"
# float32 on both sides, TF32 off: the two differ by summation order only.
FP32_ATOL = 2e-3
# bf16: srt's logits no further from transformers' float32 than transformers' own bf16 is, with
# this much slack (the residual stream and the norms are float32 in srt, bf16 in transformers).
BF16_SLACK = 1.5
LENS = (5, 17, 1, 40, 130)
STEPS = 8


def _backends() -> list[str]:
    names = ["torch_native"]
    if "triton" in ATTENTION_BACKENDS:
        names.append("triton")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pass
    else:
        names.append("flashinfer")
    return names


@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        vocab_size=1000,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # spread-out logits: greedy ties are rare
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    path = tmp_path_factory.mktemp("gpu") / "llama"
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(model_dir: Path, dtype: torch.dtype) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(CUDA).eval()


def prompts_and_greedy(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Seeded prompts of LENS tokens and transformers' float32 greedy continuation of each (STEPS
    tokens): srt decodes teacher-forced on it, so its argmax at every step is its greedy token."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in LENS]
    hf = hf_model(model_dir, torch.float32)
    greedy: list[list[int]] = []
    with torch.no_grad():
        for p in prompts:  # the whole sequence each step: no cache, no stop token
            out: list[int] = []
            for _ in range(STEPS):
                out.append(int(hf(torch.tensor([p + out], device=CUDA)).logits[0, -1].argmax()))
            greedy.append(out)
    return prompts, greedy


def runner_for(model_dir: Path, dtype: torch.dtype, backend: str, **extra: Any) -> ModelRunner:
    config = RunnerConfig(
        model_dir=model_dir,
        dtype=dtype,
        device=CUDA,
        attention_backend=backend,
        max_total_tokens=4096,
        max_running_requests=16,
    )
    return ModelRunner(dataclasses.replace(config, **extra))


def forced_logits(
    runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]], prefix_split: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the prefill's last-token logits [bs, vocab], each decode step's logits [steps, bs, vocab]),
    the decode steps teacher-forced with `forced`. With `prefix_split` > 0 each prompt longer than
    it is prefilled in two extends, the second over the first's cached tokens."""
    pool, allocator = runner.req_to_token_pool, runner.allocator
    rows = [int(pool.alloc()) for _ in prompts]  # type: ignore[arg-type]
    lens = [len(p) for p in prompts]
    done = [0] * len(prompts)
    if prefix_split:
        done = [prefix_split if n > prefix_split else 0 for n in lens]
        first = [i for i, d in enumerate(done) if d]
        loc = allocator.alloc_extend(
            pool.req_to_token, [rows[i] for i in first], [0] * len(first), [done[i] for i in first]
        )
        runner.forward(
            make_forward_batch(
                ForwardMode.EXTEND,
                [t for i in first for t in prompts[i][: done[i]]],
                [rows[i] for i in first],
                [0] * len(first),
                [done[i] for i in first],
                loc,
                CUDA,
            )
        )
    loc = allocator.alloc_extend(pool.req_to_token, rows, done, lens)
    prefill = runner.forward(
        make_forward_batch(
            ForwardMode.EXTEND, [t for p, d in zip(prompts, done) for t in p[d:]], rows, done, lens, loc, CUDA
        )
    )
    steps = []
    for step in range(len(forced[0])):
        prefix = [n + step for n in lens]
        seq = [n + 1 for n in prefix]
        loc = allocator.alloc_extend(pool.req_to_token, rows, prefix, seq)
        batch = make_forward_batch(
            ForwardMode.DECODE, [f[step] for f in forced], rows, prefix, seq, loc, CUDA
        )
        steps.append(runner.forward(batch))
    for row, n in zip(rows, lens):
        allocator.free_slots(pool.req_to_token[row, : n + len(forced[0])])
        pool.free(row)
    return prefill, torch.stack(steps)


def reference(model_dir: Path, dtype: torch.dtype, prompts: list[list[int]], forced: list[list[int]]) -> Any:
    """transformers' (last prompt token's logits [bs, vocab], teacher-forced logits [steps, bs, vocab])."""
    hf = hf_model(model_dir, dtype)
    with torch.no_grad():
        prefill = torch.stack([hf(torch.tensor([p], device=CUDA)).logits[0, -1] for p in prompts]).float()
    return prefill, hf_forced_logits_on(hf, prompts, forced)


def hf_forced_logits_on(hf: Any, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(
            [
                hf(torch.tensor([p + f], device=CUDA)).logits[0, len(p) - 1 : -1]
                for p, f in zip(prompts, forced)
            ],
            dim=1,
        ).float()


def srt_logits(
    runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]], prefix_split: int = 0
) -> torch.Tensor:
    """srt's logits at the same positions as reference's second part: the prefill's last token, then
    the decode steps of forced[:-1], [steps, bs, vocab]."""
    prefill, steps = forced_logits(runner, prompts, [f[:-1] for f in forced], prefix_split)
    return torch.cat([prefill[None], steps])


@pytest.mark.parametrize("backend", [b for b in _backends() if b != "flashinfer"])
def test_fp32_matches_transformers(backend: str, gpu_llama: Path) -> None:
    """Prefill (whole, and over a cached prefix) and ragged decode logits within FP32_ATOL of
    transformers on the GPU, and transformers' greedy tokens at every step."""
    prompts, greedy = prompts_and_greedy(gpu_llama)
    _, ref = reference(gpu_llama, torch.float32, prompts, greedy)
    runner = runner_for(gpu_llama, torch.float32, backend)
    for split in (0, 9):
        ours = srt_logits(runner, prompts, greedy, split)
        assert (ours - ref).abs().max().item() < FP32_ATOL, (backend, split, (ours - ref).abs().max().item())
        assert ours.argmax(-1).T.tolist() == greedy, (backend, split)


@pytest.mark.skipif("flashinfer" not in _backends(), reason="flashinfer is not installed")
def test_flashinfer_refuses_float32(gpu_llama: Path) -> None:
    with pytest.raises(ValueError, match="flashinfer attention backend runs bfloat16 or float16"):
        runner_for(gpu_llama, torch.float32, "flashinfer")


@pytest.mark.parametrize("backend", _backends())
def test_bf16_within_transformers_bf16_distance(backend: str, gpu_llama: Path) -> None:
    prompts, greedy = prompts_and_greedy(gpu_llama)
    _, ref = reference(gpu_llama, torch.float32, prompts, greedy)
    _, hf_bf16 = reference(gpu_llama, torch.bfloat16, prompts, greedy)
    hf_distance = (hf_bf16 - ref).abs().max().item()
    ours = srt_logits(runner_for(gpu_llama, torch.bfloat16, backend), prompts, greedy, 9)
    distance = (ours - ref).abs().max().item()
    assert distance <= BF16_SLACK * hf_distance, (backend, distance, hf_distance)


GRAPH_BACKENDS = [name for name in ("triton",) if name in ATTENTION_BACKENDS]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graphs_match_eager(backend: str, dtype: torch.dtype, gpu_llama: Path) -> None:
    """Decode replayed from captured graphs (batches padded to their bucket) against the same
    backend's eager steps: the same greedy tokens, logits within rounding (a padded batch's matmuls
    have other shapes, so other kernels may run)."""
    prompts, greedy = prompts_and_greedy(gpu_llama)
    eager = runner_for(gpu_llama, dtype, backend, disable_cuda_graph=True)
    graphs = runner_for(gpu_llama, dtype, backend)
    assert getattr(graphs.step_runner, "captured", None), getattr(graphs.step_runner, "declined", None)
    for bs in (1, 3, 4, 5):
        want = srt_logits(eager, prompts[:bs], greedy[:bs])
        got = srt_logits(graphs, prompts[:bs], greedy[:bs])
        assert torch.equal(got.argmax(-1), want.argmax(-1)), bs
        diff = (got - want).abs().max().item()
        print(f"{backend} {dtype} batch {bs}: graphs vs eager max |logit diff| {diff:.3g}")
        assert diff <= (5e-2 if dtype == torch.bfloat16 else 1e-4), (bs, diff)
