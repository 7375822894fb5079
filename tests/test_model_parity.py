"""Our model executor against transformers on the same weights (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import hf_float32, hf_greedy

from model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from model_executor.model_runner import ModelRunner
from srt.engine import Engine
from srt.sampling_params import SamplingParams

# fp32 on both sides; differences come from summation order only.
LOGIT_ATOL = 2e-4
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 1, 40)]


def prefill_batch(runner: ModelRunner, prompts: list[list[int]]) -> ForwardBatch:
    """One prefill batch of whole `prompts`, their KV slots taken from the runner's pools."""
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    seq_lens = [len(p) for p in prompts]
    loc = runner.memory.alloc_extend(rows, [0] * len(prompts), seq_lens)
    return make_forward_batch(
        ForwardMode.EXTEND, [t for p in prompts for t in p], rows, [0] * len(prompts), seq_lens, loc
    )


def our_prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    return runner.forward(prefill_batch(runner, prompts))


def check_model(
    model_dir: Path, prompts: list[list[int]], *, atol: float, srt_path: Path | None = None
) -> None:
    """srt in float32 on `srt_path` (default: `model_dir`; e.g. the same weights as a GGUF) against
    transformers in float32 on `model_dir`."""
    hf = hf_float32(model_dir)
    engine = Engine(str(srt_path or model_dir), dtype="float32", max_total_tokens=4096)
    assert engine.runner is not None
    ours = our_prefill_logits(engine.runner, prompts)
    engine.runner.memory.reset()
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < atol, f"max |logit diff| {diff} >= {atol}"

    outputs = engine.generate(prompts, GREEDY)  # all prompts decoded together in one batch
    for prompt, out in zip(prompts, outputs):
        assert out.output_ids == hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "llama_mqa", "qwen2", "qwen3"])
def test_tiny_model_matches_transformers(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    check_model(tiny_model_dirs[arch], prompts_for(320), atol=LOGIT_ATOL)


@pytest.mark.slow  # ~30 s in float32; the default path on SmolLM2 is held to transformers in the default run by test_reference_bf16
def test_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Hello",
        "Once upon a time, in a land far away, there",
    ]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    check_model(smollm2_dir, prompts, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama_mqa", "qwen3"])
def test_fresh_prompts_of_one_length_match_transformers(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    """Same-length fresh prompts prefill as one batched causal attention call: logits and the
    continuations decoded from the KV it wrote are transformers' own."""
    g = torch.Generator().manual_seed(2)
    check_model(
        tiny_model_dirs[arch],
        [torch.randint(3, 320, (12,), generator=g).tolist() for _ in range(3)],
        atol=LOGIT_ATOL,
    )


def hf_penalized_greedy(
    model: torch.nn.Module,
    prompt: list[int],
    steps: int,
    frequency: float,
    presence: float,
    repetition: float,
) -> list[int]:
    """Greedy with transformers' RepetitionPenaltyLogitsProcessor on prompt + output, then OpenAI's
    frequency and presence penalties on the output (vLLM's order), full forwards each step."""
    repeat = transformers.RepetitionPenaltyLogitsProcessor(repetition)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([prompt + out])
            scores = repeat(ids, model(ids).logits[:, -1].clone())[0]
            for token in set(out):
                scores[token] -= frequency * out.count(token) + presence
            out.append(int(scores.argmax()))
    return out


@pytest.mark.parametrize(
    ("frequency", "presence", "repetition"), [(0.0, 0.0, 1.5), (0.8, 0.4, 1.0), (0.5, -0.3, 1.2)]
)
def test_penalized_greedy_matches_transformers(
    frequency: float, presence: float, repetition: float, tiny_model_dirs: dict[str, Path]
) -> None:
    model_dir = tiny_model_dirs["llama"]
    hf = hf_float32(model_dir)
    prompts = prompts_for(320)[:3]
    params = SamplingParams(
        max_new_tokens=16,
        temperature=0.0,
        ignore_eos=True,
        frequency_penalty=frequency,
        presence_penalty=presence,
        repetition_penalty=repetition,
    )
    with Engine(str(model_dir), dtype="float32", max_total_tokens=4096) as engine:
        outputs = engine.generate(prompts, params)
        plain = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.output_ids == hf_penalized_greedy(hf, prompt, 16, frequency, presence, repetition)
    assert [o.output_ids for o in outputs] != [o.output_ids[:16] for o in plain]  # the penalties did bite


def test_min_new_tokens_holds_back_stops_as_a_masked_transformers_loop(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """A stop id the plain greedy run reaches at its third token: with min_new_tokens 8 it is masked
    for the first 8 tokens (the greedy choice among the rest, as transformers with that logit at
    -inf), and the request runs on until it is sampled after them or max_new_tokens."""
    model_dir = tiny_model_dirs["llama"]
    hf = hf_float32(model_dir)
    prompt = prompts_for(320)[1]
    with Engine(str(model_dir), dtype="float32", max_total_tokens=4096) as engine:
        stop = engine.generate([prompt], GREEDY)[0].output_ids[2]
        early = engine.generate(
            [prompt], SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop])
        )[0]
        held = engine.generate(
            [prompt],
            SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop], min_new_tokens=8),
        )[0]
    assert early.finish_reason == "stop" and len(early.output_ids) <= 3
    want: list[int] = []
    with torch.no_grad():
        while len(want) < 20:
            scores = hf(torch.tensor([prompt + want])).logits[0, -1].clone()
            if len(want) < 8:
                scores[stop] = float("-inf")
            want.append(int(scores.argmax()))
            if len(want) >= 8 and want[-1] == stop:
                break
    assert held.output_ids == want and len(held.output_ids) >= 8
    assert stop not in held.output_ids[:8]
