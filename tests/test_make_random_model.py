"""scripts/make_random_model.py: SmolLM2's shape with an even head count, loadable by srt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from make_random_model import make_random_model

from model_executor.model_runner import ModelRunner, RunnerConfig


def test_smollm2_shape_with_the_heads_asked_for(smollm2_dir: Path, tmp_path: Path) -> None:
    out = make_random_model(tmp_path / "even", num_heads=6, num_kv_heads=2, num_layers=2)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (6, 2, 96)
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (576, 1536, 49152)
    assert (out / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    runner = ModelRunner(RunnerConfig(model_dir=out, dtype=torch.bfloat16, max_total_tokens=64))
    assert runner.vocab_size == 49152


def test_heads_that_do_not_divide_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must divide by --num-heads 7"):
        make_random_model(tmp_path / "bad", num_heads=7, num_kv_heads=1, num_layers=1)


def test_word_level_tokenizer_round_trips_every_id(tmp_path: Path) -> None:
    from make_random_model import word_level_tokenizer
    from transformers import AutoTokenizer

    word_level_tokenizer(1000).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 1000 and tokenizer.eos_token_id == 2
    ids = [5, 999, 77, 3]
    assert tokenizer.decode(ids) == "w5 w999 w77 w3"
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


@pytest.mark.slow
def test_llama3_8b_shape_loads(tmp_path: Path) -> None:
    """The GPU check's checkpoint at one layer (2.3 GB): Llama-3-8B's sizes, loadable by srt."""
    from make_random_model import LLAMA3_8B, make_llama3_8b_shape

    out = make_llama3_8b_shape(tmp_path / "l3", num_layers=1)
    config = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_key_value_heads", "head_dim", "vocab_size"):
        assert config[key] == LLAMA3_8B[key]
    runner = ModelRunner(RunnerConfig(model_dir=out, dtype=torch.bfloat16, max_total_tokens=64))
    assert runner.vocab_size == 128256
