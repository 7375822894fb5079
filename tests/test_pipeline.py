"""Pipeline parallelism: layer split, per-stage weight loading, and real PP servers (gloo ranks,
hidden states and sampled ids by send/recv, micro-batches in flight) giving transformers' greedy
tokens."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from server_fixture import Server
from tiny_models import hf_float32, hf_greedy

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import (
    LAYER_PARTITION_ENV,
    PipelineStage,
    lm_head_cost_in_layers,
    partition_layers,
)
from model_executor.loader.load_weights import load_weights
from model_executor.loader.weight_source import iter_checkpoint, load_hf_config
from model_executor.models.registry import get_model_class


def test_layers_split_so_that_every_stage_reads_about_the_same_weights(smollm2_dir: Path) -> None:
    head = lm_head_cost_in_layers(load_hf_config(smollm2_dir))
    assert head == pytest.approx(8.0, abs=0.01)  # SmolLM2: 49152 x 576 embedding, 3.5M-parameter layers
    assert partition_layers(30, 2, head_cost=head) == [19, 11]  # 19 layers vs 11 layers + the head
    assert partition_layers(30, 4, head_cost=head) == [10, 9, 9, 2]
    assert partition_layers(30, 2) == [15, 15]  # no head to account for: even
    assert partition_layers(5, 3) == [2, 1, 2]
    assert partition_layers(2, 2, head_cost=0.55) == [1, 1]  # every stage keeps a layer
    assert partition_layers(7, 1, head_cost=3.0) == [7]
    assert partition_layers(30, 2, override="20,10", head_cost=head) == [20, 10]


@pytest.mark.parametrize(
    ("layers", "pp", "override", "message"),
    [
        (2, 3, None, "--pp-size 3 exceeds the model's 2 layers"),
        (30, 2, "20,11", "must give 2 positive layer counts summing to the model's 30 layers"),
        (30, 2, "30,0", "must give 2 positive layer counts"),
        (30, 2, "a,b", "must be comma-separated layer counts"),
    ],
)
def test_bad_layer_splits_are_named(layers: int, pp: int, override: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition_layers(layers, pp, override)


def test_stage_of_logs_the_split(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAYER_PARTITION_ENV, "3,2")
    with caplog.at_level("INFO", logger="srt.pipeline"):
        first = PipelineStage.of(5, 0, 2)
    assert (first.start_layer, first.end_layer, first.is_first, first.is_last) == (0, 3, True, False)
    assert PipelineStage.of(5, 1, 2) == PipelineStage(1, 2, 3, 5)
    assert "stage 0: 0-2, stage 1: 3-4" in caplog.text


@pytest.mark.parametrize("arch", ["llama_mqa", "qwen2"])  # tied embeddings / an untied head with qkv bias
def test_each_stage_loads_exactly_its_tensors(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    """Every stage loads all of its parameters and no other stage's (the loader raises on a
    missing parameter or an unused tensor); a last stage with tied embeddings gets the embedding
    as its LM head."""
    model_dir = tiny_model_dirs[arch]
    config = load_hf_config(model_dir)
    stages = []
    for pp_rank in range(2):
        stage = PipelineStage.of(config.num_hidden_layers, pp_rank, 2)
        model = get_model_class(config)(config, Communicator.single(), torch.float32, stage)
        load_weights(model, iter_checkpoint(model_dir))
        stages.append(model)
    first, last = stages
    assert first.lm_head is None and first.model.norm is None and len(first.model.local_layers) == 1
    assert last.model.embed_tokens is None and len(last.model.local_layers) == 1
    hf = hf_float32(model_dir)
    torch.testing.assert_close(last.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(first.model.embed_tokens.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(
        last.model.local_layers[0].mlp.down_proj.weight,
        hf.model.layers[1].mlp.down_proj.weight,
        rtol=0,
        atol=0,
    )


def generate_all(server: Server, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Sends every prompt at once, so several micro-batches are in flight."""

    def one(ids: list[int]) -> list[int]:
        r = server.generate(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.slow  # ~30 s; PP=2 on SmolLM2 in bf16 runs in the default run (test_reference_bf16), PP in float32 there on a tiny model
def test_pp2_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    prompts = [
        [1, 504, 3458, 282, 4649, 314],
        [1, 9690, 28, 2287, 3314, 30, 1],
        [42] * 12,
        [2, 1050, 17, 8, 9] * 3,
    ]
    hf = hf_float32(smollm2_dir)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    with Server(
        "--model-path",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--pp-size",
        "2",
        "--max-total-tokens",
        "4096",
        "--enable-rank-consensus-checker",
    ) as server:
        assert generate_all(server, prompts, 16) == expected
        # A stream's logprobs: one per token, as without streaming (the last stage records a
        # token's logprob when it launches the step, before the token is appended).
        body = {
            "input_ids": prompts[0],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        }
        want = server.generate(body).json()["meta_info"]["output_token_logprobs"]
        with requests.post(
            server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120
        ) as r:
            chunks = [
                json.loads(line[6:])
                for line in r.iter_lines(decode_unicode=True)
                if line and line != "data: [DONE]"
            ]
        assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [
            len(c["output_ids"]) for c in chunks
        ]
        assert chunks[-1]["meta_info"]["output_token_logprobs"] == want and len(want) == 12
        log = server.output()
    assert "pipeline stages own layers [19, 11] (stage 0: 0-18, stage 1: 19-29)" in log
    assert "divergence" not in log


def tp2_pp2_prompts() -> list[list[int]]:
    """Six prompts of a tiny model's vocabulary, of lengths that chunk and batch differently."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 3, 25, 14, 6, 31)]


def tp2_pp2_server(model_dir: Path, tokenizer_dir: Path) -> Server:
    """4 ranks in float32: two stages of two TP ranks each, prefills in chunks of 16, the
    rank-consensus checker on."""
    return Server(
        "--model-path",
        str(model_dir),
        "--tokenizer-path",
        str(tokenizer_dir),
        "--dtype",
        "float32",
        "--tp-size",
        "2",
        "--pp-size",
        "2",
        "--max-total-tokens",
        "2048",
        "--chunked-prefill-size",
        "16",
        "--enable-rank-consensus-checker",
    )


def test_tp2_pp2_tiny_matches_transformers(tiny_model_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    """4 ranks: two stages of two TP ranks each; tied embeddings and one KV head replicated."""
    model_dir = tiny_model_dirs["llama_mqa"]
    prompts = tp2_pp2_prompts()
    hf = hf_float32(model_dir)
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    with tp2_pp2_server(model_dir, smollm2_dir) as server:
        assert generate_all(server, prompts, 20) == expected
        assert "divergence" not in server.output()
