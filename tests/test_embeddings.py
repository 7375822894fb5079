"""`--is-embedding`: sentence-transformers' all-MiniLM-L6-v2 (a BERT encoder, from its PyPI package)
served on the default path (bf16, the C kernels) and in float32, driven by the official `openai`
client: /v1/embeddings equals transformers' mean-pooled, normalized output (cosine at least 0.999 in
float32, 0.995 in bf16), whatever the batch; base64 and float agree; /encode gives the same
vectors; bad fields and the wrong kind of server get 400s naming them. A causal LM pools its last
token. The encoder's config fields srt does not implement are refused by name at start-up."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch
import torch.nn.functional as F
import transformers
from fastapi.responses import JSONResponse
from server_fixture import Server
from test_model_parity import prefill_batch

from model_executor.cpu.encoder_runner import CpuEncoderRunner
from model_executor.model_runner import ModelRunner, RunnerConfig
from model_executor.pooler import Pooler
from srt.embeddings_api import embed_outputs, first_non_finite
from srt.http_common import OPENAI_ERRORS

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank, twice.",
    "Embeddings on a CPU are one of the commonest self-hosted jobs.",
    "Paris",
]


def reference(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """transformers float32, mean-pooled over each text's tokens and normalized (sentence-transformers'
    recipe for this model)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.fixture(scope="module")
def expected(minilm_dir: Path) -> torch.Tensor:
    return reference(minilm_dir, TEXTS)


@pytest.fixture(scope="module", params=["bf16", pytest.param("float32", marks=pytest.mark.slow)])
def server(request: pytest.FixtureRequest, minilm_dir: Path) -> Iterator[tuple[str, Server]]:
    dtype = ["--dtype", "float32"] if request.param == "float32" else []  # bf16: the default path
    with Server(
        "--model-path", str(minilm_dir), "--is-embedding", "--max-total-tokens", "4096", *dtype
    ) as server:
        yield request.param, server


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def cosines(got: list[list[float]], want: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(got, dtype=torch.float32), want)


def test_embeddings_equal_transformers_in_any_batch(
    server: tuple[str, Server], expected: torch.Tensor, minilm_dir: Path
) -> None:
    dtype, srv = server
    floor = 0.999 if dtype == "float32" else 0.995
    api = client(srv)
    batch = api.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    vectors = [d.embedding for d in batch.data]
    assert len(vectors[0]) == 384
    assert cosines(vectors, expected).min() >= floor
    one = api.embeddings.create(model="m", input=TEXTS[1], encoding_format="float").data[0].embedding
    assert cosines([one], expected[1:2]).item() >= floor
    if dtype == "float32":  # the float32 path is batch invariant to rounding
        assert torch.allclose(torch.tensor(one), torch.tensor(vectors[1]), atol=1e-5)
    # the client's default: base64, decoded by it
    encoded = api.embeddings.create(model="m", input=TEXTS).data
    assert torch.allclose(torch.tensor([d.embedding for d in encoded]), torch.tensor(vectors), atol=1e-6)
    tokens = transformers.AutoTokenizer.from_pretrained(minilm_dir)(TEXTS)["input_ids"]
    by_ids = api.embeddings.create(model="m", input=tokens, encoding_format="float")
    assert by_ids.usage.prompt_tokens == sum(map(len, tokens)) == batch.usage.prompt_tokens
    assert cosines([d.embedding for d in by_ids.data], expected).min() >= floor


def test_encode_is_sglangs_route_to_the_same_vectors(
    server: tuple[str, Server], expected: torch.Tensor
) -> None:
    _, srv = server
    one = requests.post(srv.url + "/encode", json={"text": TEXTS[0]}, timeout=60).json()
    assert one["meta_info"]["prompt_tokens"] > 2
    many = requests.post(srv.url + "/encode", json={"text": TEXTS[:2]}, timeout=60).json()
    assert len(many) == 2
    assert cosines([one["embedding"], many[1]["embedding"]], expected[[0, 1]]).min() >= 0.995


def refused(srv: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = requests.post(srv.url + path, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    return error


def test_an_embedding_server_runs_no_detokenizer(server: tuple[str, Server]) -> None:
    """The output rank sends embeddings to the front end directly (an embedding has no text): the
    node's processes are the front end and the rank, and control replies still come back."""
    _, srv = server
    info = requests.get(srv.url + "/server_info", timeout=30).json()
    assert [p["name"] for p in info["memory"]["processes"]] == ["main", "scheduler TP0"]
    assert info["internal_states"][0]  # a control call's reply, from the rank straight to the front end
    assert requests.post(srv.url + "/flush_cache", timeout=30).ok


def test_a_non_finite_embedding_is_a_500_naming_its_input() -> None:
    """orjson would write a NaN as null: an embedding holding one (or an infinity) is answered as an
    error in the API's shape, naming which input, never as a vector of nulls."""
    nan, inf = float("nan"), float("inf")
    assert first_non_finite([[0.5, -0.25], [1e308, 1e308]]) is None  # finite values whose sum overflows
    assert first_non_finite([[0.5, 0.5], [0.1, nan], [inf, 0.0]]) == 1
    assert first_non_finite([[inf, -inf]]) == 0

    class Manager:  # the TokenizerManager's two calls embed_outputs makes
        def parse_generate(self, body: dict[str, Any], embed: bool) -> None:
            return None

        async def generate(self, call: None, request: None) -> Any:
            for i, embedding in enumerate(([0.6, 0.8], [0.6, nan])):
                yield {"index": i, "embedding": embedding, "meta_info": {"finish_reason": {"type": "length"}}}

    reply = asyncio.run(embed_outputs(Manager(), None, {"text": ["a", "b"]}, OPENAI_ERRORS, {}))  # type: ignore[arg-type]
    assert isinstance(reply, JSONResponse) and reply.status_code == 500
    assert "embedding of input 1 is not finite" in json.loads(bytes(reply.body))["error"]["message"]


def test_bad_input_is_a_400_naming_it(server: tuple[str, Server]) -> None:
    dtype, srv = server
    if dtype != "bf16":
        pytest.skip("the front end's checks are the same in either dtype")
    assert refused(srv, "/v1/embeddings", {"input": TEXTS, "dimensions": 128})["param"] == "dimensions"
    assert (
        refused(srv, "/v1/embeddings", {"input": TEXTS, "encoding_format": "int8"})["param"]
        == "encoding_format"
    )
    assert refused(srv, "/v1/embeddings", {"input": [], "model": "m"})["param"] == "input"
    assert refused(srv, "/v1/embeddings", {"input": "x", "lora_path": "a"})["param"] == "lora_path"
    long = refused(srv, "/v1/embeddings", {"input": "word " * 400})  # past the model's 256 tokens
    assert long["param"] == "input" and "256" in long["message"]
    assert "--is-embedding" in refused(srv, "/generate", {"text": "hi"})["message"]
    assert (
        "--is-embedding"
        in refused(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})["message"]
    )
    reranked = srv.url + "/v1/rerank"  # a plain encoder is no cross-encoder (tests/test_rerank.py)
    answer = requests.post(reranked, json={"query": "q", "documents": ["d"]}, timeout=30)
    assert answer.status_code == 400 and "cross-encoder" in answer.text, answer.text
    same = client(srv).embeddings.create(model="m", input="ok", dimensions=384, encoding_format="float")
    assert len(same.data[0].embedding) == 384  # and it goes on serving


def runner_embeddings(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """The runner's embeddings of `prompts` in one prefill batch, as the scheduler runs it."""
    out = torch.tensor(runner.embed(prefill_batch(runner, prompts)))
    runner.memory.reset()
    return out


def test_float32_embeddings_equal_transformers(minilm_dir: Path, expected: torch.Tensor) -> None:
    prompts = transformers.AutoTokenizer.from_pretrained(minilm_dir)(TEXTS)["input_ids"]
    runner = encoder_runner(minilm_dir)
    batch = runner_embeddings(runner, prompts)
    assert cosines(batch.tolist(), expected).min() >= 0.999
    alone = runner_embeddings(runner, prompts[1:2])
    assert torch.allclose(alone[0], batch[1], atol=1e-5)  # the batch does not move it


def assert_fused_layers_give_the_modules_bits(model_dir: Path, prompts: list[list[int]]) -> None:
    """On the default path (bf16, our kernels) on one rank an encoder's layers run as one
    srt_bert_layer call each (CpuEncoderRunner), which makes the modules' kernel calls in their
    order: the same final hidden states, bit for bit, for all the prompts together, each alone, and
    one token; and the runner's embeddings are those."""
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, max_total_tokens=512, is_embedding=True))
    fused = runner.step_runner
    assert isinstance(fused, CpuEncoderRunner) and fused.model is not None and fused.layers
    for batch_prompts in (prompts, *([p] for p in prompts), [prompts[0][:1]]):
        batch = prefill_batch(runner, batch_prompts)
        assert fused.can_run(batch)
        with torch.inference_mode():
            got = fused.run(batch)
            want = runner.model(batch.input_ids, batch.positions, batch, None)
        assert torch.equal(got, want)
        pool = getattr(runner.model, "pool", runner.pooler)
        assert runner.embed(batch) == pool(want, batch.extend_seq_lens_cpu).tolist()
        runner.memory.reset()


def test_bf16_layers_run_fused_with_the_modules_bits(minilm_dir: Path) -> None:
    prompts = transformers.AutoTokenizer.from_pretrained(minilm_dir)(TEXTS)["input_ids"]
    assert_fused_layers_give_the_modules_bits(minilm_dir, prompts)


def test_a_causal_lm_pools_its_last_token(tiny_model_dirs: dict[str, Path]) -> None:
    """No sentence-transformers files: the last token's final hidden state, normalized."""
    path = tiny_model_dirs["llama"]
    assert Pooler.of_checkpoint(path) == Pooler("last", True)
    prompts = [[1, 5, 9, 13], [2, 7, 100, 41, 3, 8, 9]]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = [model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1] for p in prompts]
    got = runner_embeddings(encoder_runner(path), prompts)
    assert cosines(got.tolist(), F.normalize(torch.stack(want), dim=-1)).min() >= 0.9999


def encoder_runner(path: Path, is_embedding: bool = True) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(model_dir=path, dtype=torch.float32, max_total_tokens=512, is_embedding=is_embedding)
    )


def test_an_encoder_serves_only_embeddings_and_its_fields_are_checked(
    minilm_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ValueError, match="BertModel is an encoder: it serves embeddings, with --is-embedding"
    ):
        encoder_runner(minilm_dir, is_embedding=False)
    assert encoder_runner(minilm_dir).context_length == 256  # sentence-transformers' max_seq_length
    copy = Path(shutil.copytree(minilm_dir, tmp_path / "m"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(
        ValueError, match=r"position_embedding_type='relative_key' \(relative position embeddings\)"
    ):
        encoder_runner(copy)
    pooling = copy / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling max_tokens is not implemented by srt"):
        Pooler.of_checkpoint(copy)


@pytest.mark.slow
def test_tensor_parallel_embeddings_equal_transformers(minilm_dir: Path, expected: torch.Tensor) -> None:
    with Server("--model-path", str(minilm_dir), "--is-embedding", "--tp", "2") as srv:
        got = client(srv).embeddings.create(model="m", input=TEXTS, encoding_format="float")
    assert cosines([d.embedding for d in got.data], expected).min() >= 0.995
