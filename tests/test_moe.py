"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, OLMoE) against
transformers on the same tiny random weights: float32 logits and greedy tokens at TP=1 and across
four ranks (TP=2 x PP=2), the default bf16 path within transformers' own bf16 distance from float32,
and the routing every rank agrees on."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
import transformers
from gguf_files import write_qwen_moe_gguf
from server_fixture import Server
from test_config_refusal import edited, runner, save_tiny
from test_deterministic import check_prefix_mode, check_single_mode, ways
from test_model_parity import LOGIT_ATOL, check_model, prompts_for
from test_pipeline import generate_all, tp2_pp2_prompts, tp2_pp2_server
from test_restart import smollm2_payloads, streams_through_a_kill
from tiny_models import ARCHS, MOE_ARCHS, hf_float32, hf_greedy, make_tiny_model

from model_executor.cpu.kernels import build, packing
from model_executor.cpu.linear import packed_of, set_one_arithmetic
from model_executor.cpu.moe import FusedExperts
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.layers.moe import Expert, SparseMoeBlock, select_experts
from model_executor.model_runner import ModelRunner, RunnerConfig
from srt.engine import Engine

MOE_EXTRA = {ARCHS[arch][0]: ARCHS[arch][2] for arch in MOE_ARCHS}  # config class -> its tiny fields


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_model(arch, root / arch) for arch in MOE_ARCHS}


def test_top_k_ties_go_to_the_lowest_expert_id() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))


@pytest.mark.skipif(build.kernels() is None, reason="the CPU kernels did not build here")
def test_the_kernels_route_as_select_experts() -> None:
    """srt_moe_route (cpu_moe.c), which the fused layers route with: the ties above, and random
    logits, to float32 rounding of the softmax."""
    lib = build.kernels()
    assert lib is not None
    ties = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    randn = torch.randn(64, 60, generator=torch.Generator().manual_seed(0)) * 3
    for logits, top_k in ((ties, 2), (randn, 4), (randn, 1)):
        for renormalize in (False, True):
            m, experts = logits.shape
            ids = torch.empty(m, top_k, dtype=torch.int64)
            weights = torch.empty(m, top_k)
            lib.srt_moe_route(
                logits.data_ptr(),
                experts,
                m,
                experts,
                top_k,
                int(renormalize),
                ids.data_ptr(),
                weights.data_ptr(),
            )
            want_weights, want_ids = select_experts(logits, top_k, renormalize)
            assert ids.tolist() == want_ids.tolist()
            torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_float32_matches_transformers(arch: str, moe_dirs: dict[str, Path]) -> None:
    """Last-position logits within float32's summation noise, 32 greedy tokens of 4 prompts equal."""
    check_model(moe_dirs[arch], prompts_for(320), atol=LOGIT_ATOL)


def every_position_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """srt's logits at every position of the prompts, prefilled together in one step."""
    runner = engine.runner
    assert runner is not None
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    lens = [len(p) for p in prompts]
    loc = runner.memory.alloc_extend(rows, [0] * len(prompts), lens)
    batch = make_forward_batch(
        ForwardMode.EXTEND, [t for p in prompts for t in p], rows, [0] * len(prompts), lens, loc
    )
    _, logits = runner.forward_with_token_logits(batch, list(range(sum(lens))))
    assert logits is not None
    return logits


def mean_logprob_distance(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return (logits.float().log_softmax(-1) - reference.float().log_softmax(-1)).abs().mean().item()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bf16_is_no_further_from_float32_than_transformers_bf16(arch: str, moe_dirs: dict[str, Path]) -> None:
    """The default path (bf16, the CPU kernels): the log-probabilities at every position of 8 prompts
    (215 positions) no further from transformers' float32 than transformers' own bf16 is (x 1.25).
    Measured: 0.75-0.86x. A near-tie of the router flipped by rounding moves
    a position's distance far more than the rest of the arithmetic: the tiny models' routers are
    10x wider than their other weights (tiny_models.py), so that few are near."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 19, 33, 4, 50, 12, 26, 64)]
    hf = hf_float32(moe_dirs[arch])
    with torch.no_grad():
        reference = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
        hf_bf16 = hf.to(torch.bfloat16)
        theirs = torch.cat([hf_bf16(torch.tensor([p])).logits[0] for p in prompts])
    ours = every_position_logits(
        Engine(str(moe_dirs[arch]), dtype="bfloat16", max_total_tokens=2048), prompts
    )
    budget = mean_logprob_distance(theirs, reference)
    got = mean_logprob_distance(ours, reference)
    print(
        f"{arch}: mean |dlogprob| from transformers float32: srt bf16 {got:.5f}, transformers bf16 {budget:.5f}"
    )
    assert got <= 1.25 * budget


@pytest.mark.skipif(
    build._compiler() is None or not build.int8_available(),
    reason="neither AMX int8 tiles nor AVX-512 VNNI here: --quantization w8a8_int8 is refused",
)
def test_w8a8_int8_experts_run_each_active_expert_once_a_step(
    moe_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--quantization w8a8_int8 on a mixture of experts: every expert's gate_up and down are int8, a
    step runs each active expert once for all of its tokens (its weights read once), and the
    log-probabilities at every position stay within 4x transformers' own bf16 distance from float32
    (int8 rounds more than bf16)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 19, 33)]
    hf = hf_float32(moe_dirs["qwen3_moe"])
    with torch.no_grad():
        reference = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
        theirs = torch.cat([hf.to(torch.bfloat16)(torch.tensor([p])).logits[0] for p in prompts])
    engine = Engine(
        str(moe_dirs["qwen3_moe"]), dtype="bfloat16", max_total_tokens=2048, quantization="w8a8_int8"
    )
    assert engine.runner is not None
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    experts = [e for block in blocks for e in block.experts]
    assert blocks and all(
        isinstance(packed_of(linear.linear_method), packing.Int8Weight)
        for e in experts
        for linear in (e.gate_up_proj, e.down_proj)  # type: ignore[union-attr]
    )
    calls: list[int] = []
    real = Expert.partial
    monkeypatch.setattr(Expert, "partial", lambda self, x: (calls.append(id(self)), real(self, x))[1])
    routes: list[torch.Tensor] = []
    for block in blocks:
        block.route_hook = lambda layer_id, ids: routes.append(ids.clone())
    ours = every_position_logits(engine, prompts)
    chosen = sum(len(ids.unique()) for ids in routes)  # the distinct experts each layer chose
    assert len(calls) == len(set(calls)) == chosen  # each once, for all of its tokens
    budget, got = mean_logprob_distance(theirs, reference), mean_logprob_distance(ours, reference)
    assert got <= 4 * budget, (got, budget)


@pytest.mark.parametrize(
    "arch",
    # ~20-25 s each: the slow tier (the default run holds every MoE at TP=1); OLMoE checks k's norm
    # across heads over a KV head both TP ranks hold
    [pytest.param(arch, marks=pytest.mark.slow) for arch in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")],
)
def test_four_ranks_match_transformers(arch: str, moe_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    """TP=2 x PP=2 in float32: each expert sharded over two ranks, the layers over two stages, the
    routing replicated; greedy tokens of six prompts (several micro-batches in flight) are
    transformers'. The rank-consensus checker sees no divergence."""
    model_dir = moe_dirs[arch]
    prompts = tp2_pp2_prompts()
    hf = hf_float32(model_dir)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    with tp2_pp2_server(model_dir, smollm2_dir) as server:
        assert generate_all(server, prompts, 16) == expected
        # the logits behind them: each chosen token's logprob is transformers'
        r = server.generate(
            {
                "input_ids": prompts[2],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
            }
        )
        logprobs = [lp for lp, _, _ in r.json()["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            seq = torch.tensor([prompts[2] + expected[2]])
            ref = hf(seq).logits[0, len(prompts[2]) - 1 : -1].log_softmax(-1)
        want = ref.gather(1, torch.tensor(expected[2])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), want, rtol=0, atol=1e-4)
        assert "divergence" not in server.output()


def test_what_srt_lacks_is_refused_by_name(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    """OLMoE's clip_qkv."""
    with pytest.raises(
        ValueError, match=r"^config\.json: clip_qkv=8\.0 \(q, k and v clamped to \+-clip_qkv\)"
    ):
        runner(edited(moe_dirs["olmoe"], tmp_path / "olmoe", clip_qkv=8.0))


def test_sliding_windows_of_moe_models_match_transformers(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Mixtral's window, and Qwen3-MoE's where use_sliding_window is set, in every layer (transformers
    reads no layer_types for either): 16 tokens, prompts and continuations past it."""
    mixtral = edited(moe_dirs["mixtral"], tmp_path / "mixtral", sliding_window=16)
    check_model(mixtral, prompts_for(320), atol=LOGIT_ATOL)
    qwen3 = edited(
        moe_dirs["qwen3_moe"],
        tmp_path / "qwen3",
        use_sliding_window=True,
        sliding_window=16,
    )
    layers = runner(qwen3).model.model.local_layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [16, 16]
    check_model(qwen3, prompts_for(320), atol=LOGIT_ATOL)


@pytest.mark.parametrize(
    "config_cls, model_cls, fields",
    [
        (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, {"attention_bias": True}),
        (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, {"qkv_bias": False}),
    ],
    ids=["olmoe_attention_bias", "qwen2_moe_no_qkv_bias"],
)
def test_bias_fields_match_transformers(
    config_cls: Any, model_cls: Any, fields: dict[str, Any], tmp_path: Path
) -> None:
    """OLMoE's attention_bias puts biases on q, k, v and o; Qwen2-MoE's qkv_bias false drops q/k/v's."""
    extra = dict(MOE_EXTRA[config_cls], **fields)
    path = save_tiny(tmp_path / "m", config_cls, model_cls, **extra)
    check_model(path, prompts_for(320), atol=LOGIT_ATOL)


# ---------------------------------------------------------------- deterministic inference (bf16)


@pytest.fixture(scope="module")
def moe_smollm2_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3_moe_smollm2_vocab", tmp_path_factory.mktemp("moe") / "smollm2_vocab")


@pytest.mark.slow  # ~20 s a case (the default run stays under the README's 20 minutes)
@pytest.mark.parametrize("arch", ["qwen3_moe_smollm2_vocab", "qwen2_moe_smollm2_vocab"])
def test_qwen_moe_from_gguf_matches_transformers(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint as llama.cpp's converter writes a Qwen3-MoE or Qwen2-MoE GGUF (stacked experts,
    the expert sizes under expert_feed_forward_length and expert_shared_feed_forward_length, which
    transformers' GGUF config leaves at their defaults): srt on the GGUF equals transformers on the
    safetensors, logits and greedy tokens."""
    monkeypatch.setenv("SRT_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = make_tiny_model(arch, tmp_path / arch)
    gguf_path = write_qwen_moe_gguf(model_dir, tmp_path / f"{arch}.gguf")
    check_model(model_dir, prompts_for(49152), atol=LOGIT_ATOL, srt_path=gguf_path)


@pytest.mark.skipif(build.kernels() is None, reason="deterministic inference is exact on the CPU kernels")
def test_prefill_and_decode_route_and_sum_one_token_alike(moe_smollm2_vocab: Path) -> None:
    """With --enable-deterministic-inference a token's logits and K/V have the same bits decoded
    alone, decoded in a batch, prefilled at once and prefilled in chunks (test_deterministic's
    four ways): its experts, their weights and their sum do not depend on the step's other tokens."""
    runner = ModelRunner(
        RunnerConfig(
            model_dir=moe_smollm2_vocab,
            dtype=torch.bfloat16,
            max_total_tokens=512,
            max_running_requests=8,
            deterministic=True,
        )
    )
    set_one_arithmetic(True)
    try:
        got = ways(runner)
    finally:
        set_one_arithmetic(False)
    want_logits, want_kv = got["decoded alone"]
    for name, (logits, kv) in got.items():
        assert torch.equal(kv, want_kv), f"{name}: K/V differ from decode's"
        assert torch.equal(logits, want_logits), (
            f"{name}: logits differ by {(logits - want_logits).abs().max()}"
        )


@pytest.fixture(scope="module")
def moe_det_server(moe_smollm2_vocab: Path, smollm2_dir: Path) -> Any:
    with Server(
        "--model-path",
        str(moe_smollm2_vocab),
        "--tokenizer-path",
        str(smollm2_dir),
        "--enable-deterministic-inference",
        "--max-total-tokens",
        "4096",
    ) as server:
        yield server


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_single_mode_on_moe(moe_det_server: Server, seeded: bool) -> None:
    check_single_mode(moe_det_server, seeded)


def test_prefix_mode_on_moe(moe_det_server: Server) -> None:
    check_prefix_mode(moe_det_server)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_streams_survive_sigkill_with_their_exact_tokens(
    moe_smollm2_vocab: Path, smollm2_dir: Path
) -> None:
    """bf16 at TP=2 (every expert split over the two ranks), --restart-on-failure: rank 1 SIGKILLed
    mid-stream in eight streams (greedy and seeded, with logprobs); each stream's ids, text and
    logprobs equal a fault-free run's, bit for bit."""
    tokens = 192
    args = ("--model-path", str(moe_smollm2_vocab), "--tokenizer-path", str(smollm2_dir), "--tp-size", "2")
    with Server(*args, "--restart-on-failure", "1") as server:
        bodies = smollm2_payloads(tokens)
        with ThreadPoolExecutor(len(bodies)) as pool:
            expected = [r.json() for r in pool.map(lambda b: server.generate(b, timeout=600), bodies)]
        assert all(len(e["output_ids"]) == tokens for e in expected), [e.get("error") for e in expected]
        assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200
        results = streams_through_a_kill(server, bodies, "srt::scheduler_TP1", after=60, timeout=600)
        out = server.output()
        assert "killed by signal SIGKILL; restarting the engine" in out and "engine restarted in" in out
        for i, ((ids, text, logprobs, _), want) in enumerate(zip(results, expected)):
            assert ids == want["output_ids"], f"stream {i}"
            assert text == want["text"]
            assert logprobs == want["meta_info"]["output_token_logprobs"], f"stream {i}'s logprobs"


@pytest.mark.skipif(not build.bf16_linear_available(), reason="the packed bf16 kernels did not build here")
def test_one_kernel_call_per_layer_equals_the_expert_loop(moe_dirs: dict[str, Path]) -> None:
    """The CPU wing runs each layer's active experts in one C call (cpu/moe.py); it adds what the
    torch loop over the experts' linear methods adds, to float32 rounding (the C loop may fuse the
    weight's multiply with the add)."""
    engine = Engine(str(moe_dirs["qwen2_moe"]), dtype="bfloat16", max_total_tokens=256)
    assert engine.runner is not None
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.experts_method, FusedExperts) for b in blocks)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for block in blocks:
        fused = block(x)
        method, block.experts_method = block.experts_method, None
        try:
            loop = block(x)
        finally:
            block.experts_method = method
        torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- return_routed_experts (SGLang's)


def hf_routes(hf: Any, ids: list[int]) -> dict[int, list[list[int]]]:
    """transformers' top-k experts of each token, by layer (layers with a router only), each sorted."""
    routes: dict[int, list[list[int]]] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:

            def hook(module: Any, args: Any, out: Any, i: int = i) -> None:
                routes[i] = sorted_rows(out[2])

            hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return routes


def sorted_rows(ids: Any) -> list[list[int]]:
    return [sorted(row) for row in torch.as_tensor(ids).reshape(-1, ids.shape[-1]).tolist()]


@pytest.mark.slow  # ~20 s: a server per case
def test_routed_experts_are_transformers_routes(moe_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    """--enable-return-routed-experts (float32): meta_info.routed_experts, base64 int32 [tokens fed,
    layers, top_k], holds transformers' experts for the prompt and every output token but the last
    (-1 in the dense layer); routed_experts_start_len drops the first tokens; a prefix-cache hit
    returns the same routes; without the flag the request is a 400 naming it."""
    model_dir = moe_dirs["qwen3_moe"]  # 2 layers, layer 1 dense; top 4 of 32
    prompt = [5, 17, 99, 3, 250, 41, 8, 77, 120]
    body = {
        "input_ids": prompt,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    }
    hf = hf_float32(model_dir)
    args = ("--model-path", str(model_dir), "--tokenizer-path", str(smollm2_dir), "--dtype", "float32")
    with Server(*args, "--enable-return-routed-experts") as server:
        first = server.generate(body).json()
        again = server.generate(body).json()
        tail = server.generate({**body, "routed_experts_start_len": 4}).json()
        plain = server.generate({k: v for k, v in body.items() if k != "return_routed_experts"}).json()
    fed = prompt + first["output_ids"][:-1]
    routes = np.frombuffer(base64.b64decode(first["meta_info"]["routed_experts"]), dtype=np.int32)
    routes = routes.reshape(len(fed), 2, 4)
    assert sorted_rows(torch.from_numpy(routes[:, 0].copy())) == hf_routes(hf, fed)[0]
    assert (routes[:, 1] == -1).all()
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["meta_info"]["routed_experts"] == first["meta_info"]["routed_experts"]
    assert base64.b64decode(tail["meta_info"]["routed_experts"]) == routes[4:].tobytes()
    assert "routed_experts" not in plain["meta_info"]
    with Server(*args) as server:
        r = server.generate(body)
    assert r.status_code == 400 and "--enable-return-routed-experts" in r.text, r.text


def test_routed_experts_need_experts(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(
        ValueError, match="--enable-return-routed-experts: LlamaForCausalLM has no mixture-of-experts"
    ):
        ModelRunner(
            RunnerConfig(
                model_dir=tiny_model_dirs["llama"],
                dtype=torch.float32,
                max_total_tokens=256,
                return_routed_experts=True,
            )
        )


def test_metrics_count_the_tokens_of_each_expert(moe_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    """/metrics: srt:moe_expert_tokens (each expert's tokens since start, over the rank's MoE
    layers) and srt:moe_routing_skew (busiest over mean); /server_info has the same counts."""
    prompts = [[5, 17, 99, 3, 250, 41, 8], [9, 11, 300, 2, 64]]  # 7 + 5 prompt tokens, no shared prefix
    with Server(
        "--model-path",
        str(moe_dirs["mixtral"]),  # top 2 of 8 in both layers
        "--tokenizer-path",
        str(smollm2_dir),
        "--enable-metrics",
        "--decode-log-interval",
        "1",
    ) as server:
        for ids in prompts:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            }
            assert server.generate(body).status_code == 200
        text = requests.get(server.url + "/metrics", timeout=10).text
        info = requests.get(server.url + "/server_info", timeout=10).json()
    counts = {
        int(line.split('expert="')[1].split('"')[0]): float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("srt:moe_expert_tokens{")
    }
    fed = sum(len(p) + 4 - 1 for p in prompts)  # every prompt token and every output token but the last
    assert sorted(counts) == list(range(8)) and sum(counts.values()) == fed * 2 * 2  # top 2, 2 layers
    skew = next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("srt:moe_routing_skew{")
    )
    assert skew == pytest.approx(max(counts.values()) / (sum(counts.values()) / 8))
    assert str([int(counts[e]) for e in range(8)]) in str(info)
