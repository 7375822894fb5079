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
