"""SGLang's /v1/rerank on a cross-encoder (a tiny random BertForSequenceClassification with
all-MiniLM-L6-v2's tokenizer) served on the default path: each document's score is transformers'
on the same (query, document) pair, the list comes highest first, `top_n` and `return_documents`
shape it, and what it cannot serve is a 400 naming the field."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
import transformers
from server_fixture import Server
from test_embeddings import assert_fused_layers_give_the_modules_bits

QUERY = "Where do penguins live?"
DOCUMENTS = [
    "Penguins live almost only in the Southern Hemisphere, many of them in Antarctica.",
    "The stock market closed higher on Tuesday.",
    "A recipe for bread needs flour, water, salt and yeast.",
    "Emperor penguins breed on the sea ice around Antarctica in winter.",
    "Paris is the capital of France.",
]
# bf16 linears against transformers' float32: the scores' distance bound (they spread over ~2)
SCORE_ATOL = 0.03


@pytest.fixture(scope="module")
def cross_encoder(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rerank") / "tiny-cross-encoder"
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        num_labels=1,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # weights wider than init, so the documents' scores spread apart
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embeddings" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_dir / name).exists():
            shutil.copy(minilm_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def expected(cross_encoder: Path) -> list[float]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    model = transformers.BertForSequenceClassification.from_pretrained(
        cross_encoder, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        batch = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")
        return model(**batch).logits[:, 0].tolist()


@pytest.fixture(scope="module")
def server(cross_encoder: Path) -> Iterator[Server]:
    with Server("--model-path", str(cross_encoder), "--is-embedding", "--max-total-tokens", "4096") as server:
        yield server


def rerank(server: Server, **body: object) -> requests.Response:
    return requests.post(
        server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, **body}, timeout=60
    )


def test_scores_are_transformers_highest_first(server: Server, expected: list[float]) -> None:
    response = rerank(server)
    assert response.status_code == 200, response.text
    answers = response.json()
    assert sorted(a["index"] for a in answers) == list(range(len(DOCUMENTS)))
    for answer in answers:
        assert answer["document"] == DOCUMENTS[answer["index"]]
        assert abs(answer["score"] - expected[answer["index"]]) < SCORE_ATOL, (answer, expected)
    position = {a["index"]: rank for rank, a in enumerate(answers)}
    assert [a["score"] for a in answers] == sorted((a["score"] for a in answers), reverse=True)
    apart = [(i, j) for i in position for j in position if expected[i] - expected[j] > 2 * SCORE_ATOL]
    assert len(apart) >= len(DOCUMENTS), f"the tiny model's scores are too close to order: {expected}"
    assert all(position[i] < position[j] for i, j in apart), (answers, expected)
    assert answers[0]["meta_info"]["prompt_tokens"] > len(QUERY.split())  # the pair, not the document


def test_top_n_and_return_documents(server: Server, expected: list[float]) -> None:
    answers = rerank(server, top_n=2, return_documents=False).json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert expected[order[1]] - expected[order[2]] > 2 * SCORE_ATOL  # the first two, whatever their order
    assert {a["index"] for a in answers} == set(order[:2])
    assert all("document" not in a for a in answers)


def test_bf16_layers_run_fused_with_the_modules_bits(cross_encoder: Path) -> None:
    """Pairs, whose document tokens are of type 1, through the fused layers: the modules' bits."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    assert_fused_layers_give_the_modules_bits(
        cross_encoder, tokenizer([QUERY] * 3, DOCUMENTS[:3])["input_ids"]
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"top_n": 0}, "top_n"),
        ({"documents": []}, "documents"),
        ({"query": ["text"]}, "query"),
        ({"instruct": "Judge relevance"}, "instruct"),
        ({"query": "penguins [SEP] ice"}, "query"),
    ],
)
def test_bad_fields_are_a_400_naming_them(server: Server, body: dict[str, object], field: str) -> None:
    response = rerank(server, **body)
    assert response.status_code == 400, response.text
    assert field in response.text
    assert rerank(server).status_code == 200  # and it keeps serving
