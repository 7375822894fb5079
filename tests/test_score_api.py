"""SGLang's /v1/score on the default server (bundled SmolLM2, bf16): text query and items tokenized as
SGLang does, scores within bf16's distance of transformers' float32 next-token probabilities, and
the labels' order the same. (Exactness in float32, and the 400s: tests/test_logprobs.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from server_fixture import Server
from tiny_models import hf_float32
from transformers import AutoTokenizer

QUERY = "Is the following city the capital of France? Answer yes or no.\nCity:"
ITEMS = [" Paris", " Berlin", " Lyon"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--max-total-tokens", "4096") as server:
        yield server


def test_text_scores_follow_transformers(server: Server, smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    labels = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" yes", " no", " Yes", " No")]
    r = requests.post(
        f"{server.url}/v1/score",
        json={"query": QUERY, "items": ITEMS, "label_token_ids": labels, "model": "default"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    scores = torch.tensor(r.json()["scores"])
    hf = hf_float32(smollm2_dir)
    query_ids = tokenizer.encode(QUERY)
    with torch.no_grad():
        ref = torch.stack(
            [
                torch.softmax(
                    hf(torch.tensor([query_ids + tokenizer.encode(item, add_special_tokens=False)])).logits[
                        0, -1
                    ],
                    dim=-1,
                )[labels]
                for item in ITEMS
            ]
        )
    # probabilities: bf16 moves them by a few hundredths at most on these prompts
    torch.testing.assert_close(scores, ref, atol=0.03, rtol=0.1)
    assert scores.argmax(-1).tolist() == ref.argmax(-1).tolist()
    softmaxed: Any = requests.post(
        f"{server.url}/v1/score",
        json={"query": QUERY, "items": ITEMS, "label_token_ids": labels[:2], "apply_softmax": True},
        timeout=60,
    ).json()
    for row in softmaxed["scores"]:
        assert abs(sum(row) - 1.0) < 1e-6
