"""The real Qwen2.5-Coder Instruct GGUF files (Q4_K_M, scripts/real_models.py) against transformers
on the same weights: --quantization gguf on the file's own blocks (Q5_0, Q8_0, Q4_K and Q6_K on the
0.5B; Q4_K and Q6_K on the 1.5B), each decode step's logits within the GGUF tolerance the tiny
K-quant models are held to (3% of the largest), and transformers' greedy tokens served with
--quantization gguf up to float32's first near-tie (the default bf16 path serves the 1.5B in
tests/test_fim.py's slow test)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import real_models
import torch
import transformers
from server_fixture import Server
from test_cpu_kernels import decode_logits
from test_model_families import first_tie
from test_pipeline import generate_all
from tiny_models import hf_greedy

from model_executor.cpu.kernels import build, packing
from model_executor.cpu.linear import packed_of
from model_executor.layers.linear import LinearBase
from model_executor.loader.model_path import resolve_model_path
from model_executor.model_runner import ModelRunner, RunnerConfig

PROMPTS = [
    "def fibonacci(n):\n    ",
    "# Sort a list of dictionaries by the key 'age'\npeople.sort(",
    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
]
TOKENS = 16

needs_kernels = pytest.mark.skipif(
    not (build.q4k_available() and build.q8_available()), reason="no Q4_K and 8-bit kernels on this CPU"
)


def reference(name: str) -> tuple[Path, Any, list[list[int]], list[list[int]], list[int]]:
    """The assembled file, transformers' float32 model on it (read from srt's conversion: the values
    transformers dequantized from the file), the prompts' ids, its greedy tokens and first near-ties."""
    if not real_models.available(name):
        pytest.skip(f"{name} is not installed: {real_models.install_command(name)}")
    path = real_models.path(name)
    model_dir = resolve_model_path(str(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, TOKENS) for p in prompts]
    ties = [first_tie(hf, p, e) for p, e in zip(prompts, expected)]
    return path, hf, prompts, expected, ties


@pytest.fixture(scope="module")
def coder_0_5b() -> tuple[Path, Any, list[list[int]], list[list[int]], list[int]]:
    return reference("qwen2.5-coder-0.5b")


@needs_kernels
def test_qwen_coder_0_5b_decodes_on_the_file_blocks_as_transformers(
    coder_0_5b: tuple[Path, Any, list[list[int]], list[list[int]], list[int]],
) -> None:
    """Every linear of the 0.5B on its blocks read from the file (its Q5_0 and Q8_0 qkv joined, its
    biases added by the 8-bit kernel), no dense weight kept, and each decode step's logits within 3%
    of transformers' float32 on the same values, greedy picks equal up to the first near-tie."""
    path, hf, prompts, expected, ties = coder_0_5b
    runner = ModelRunner(
        RunnerConfig(model_dir=resolve_model_path(str(path)), max_total_tokens=1024, quantization="gguf")
    )
    linears = {n: m for n, m in runner.model.named_modules() if isinstance(m, LinearBase)}
    packed = [packed_of(m.linear_method) for m in linears.values()]
    kinds = {type(p) for p in packed}
    assert kinds <= {packing.Q4KWeight, packing.Q8Weight}, kinds
    # its Q4_K and Q6_K down_proj (k 4864) on the file's own scales (Q6_K's where AVX-512 VNNI runs)
    layouts = {(type(p), p.packed.shape[1] * 32, p.packed.shape[-1]) for p in packed if p is not None}
    six = packing.Q6KS_BLOCK_BYTES if build.q6ks_available() else packing.Q6K_BLOCK_BYTES
    down = {(kind, size) for kind, k, size in layouts if k == 4864}
    assert down == {(packing.Q4KWeight, packing.Q4KS_BLOCK_BYTES), (packing.Q8Weight, six)}, layouts
    if build.gguf_linear_available():
        assert all(m.weight.device.type == "meta" for n, m in linears.items() if n != "lm_head")
    forced = [e[: TOKENS - 1] for e in expected]  # step s decodes expected[s] and should pick expected[s + 1]
    logits = decode_logits(runner, prompts, forced)
    ref = torch.stack(
        [hf(torch.tensor([p + f])).logits[0, len(p) :].detach() for p, f in zip(prompts, forced)], dim=1
    )
    err = (logits.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 0.03, err
    picks = logits.argmax(-1).T.tolist()  # [bs, steps]
    for pick, want, tie in zip(picks, expected, ties):
        assert pick[: tie - 1] == want[1:tie], (tie, pick, want)


@pytest.mark.slow  # a server on the 0.5B
def test_qwen_coder_0_5b_served_on_its_blocks_matches_transformers(
    coder_0_5b: tuple[Path, Any, list[list[int]], list[list[int]], list[int]],
) -> None:
    path, _, prompts, expected, ties = coder_0_5b
    with Server("--model-path", str(path), "--quantization", "gguf", startup_timeout=600) as server:
        served = generate_all(server, prompts, TOKENS)
        assert re.search(r"blocks read from qwen2\.5-coder-0\.5b", server.output())
    for got, want, tie in zip(served, expected, ties):
        assert got[:tie] == want[:tie], (tie, got, want)


@pytest.mark.slow
@needs_kernels
def test_qwen_coder_1_5b_served_on_its_blocks_matches_transformers() -> None:
    """The 1.5B with --quantization gguf: every linear of 28 layers and the LM head on the file's
    Q4_K and Q6_K blocks (half the qkv split: v on Q6_K's kernel beside Q4_K q and k), none left
    bf16, greedy tokens transformers' float32 ones up to its first near-tie."""
    path, _, prompts, expected, ties = reference("qwen2.5-coder-1.5b")
    with Server("--model-path", str(path), "--quantization", "gguf", startup_timeout=600) as server:
        served = generate_all(server, prompts, TOKENS)
        log = server.output()
    assert "84 Q4_K, 15 8-bit (Q8_0, Q5_0, Q4_0 or Q6_K blocks), 14 split" in log, log[-3000:]
    assert "stay bf16" not in log, log[-3000:]
    for got, want, tie in zip(served, expected, ties):
        assert got[:tie] == want[:tie], (tie, got, want)
