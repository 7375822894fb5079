"""A config.json field that changes the math and that srt does not implement is a start-up error
naming the field and its value (model_executor/models/config_check.py), raised before any weight is
read; what srt does implement loads, and matches transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from test_model_parity import LOGIT_ATOL, check_model, prompts_for
from tiny_models import TINY

from model_executor.attention.torch_native import TorchNativeAttnBackend
from model_executor.model_runner import ModelRunner, RunnerConfig


def save_tiny(path: Path, config_cls: Any, model_cls: Any, **extra: Any) -> Path:
    """A tiny random checkpoint made by transformers, biases random too (they start at zero)."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def edited(src: Path, dst: Path, **fields: Any) -> Path:
    """A copy of the checkpoint at `src` whose config.json has `fields` set (None: null)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def runner(path: Path, context_length: int | None = None) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(model_dir=path, dtype=torch.float32, max_total_tokens=256, context_length=context_length)
    )


@pytest.fixture(scope="module")
def mistral_window_16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mistral") / "window_16"
    return save_tiny(path, transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=16)


def test_mistral_sliding_window_matches_transformers(mistral_window_16: Path) -> None:
    """Every layer attends within 16 tokens: prompts and continuations well past the window, in
    prefill (SDPA's masks) and decode (the C kernel's window)."""
    check_model(mistral_window_16, prompts_for(320), atol=LOGIT_ATOL)


def test_mistral_window_as_wide_as_the_context_matches_transformers(tmp_path: Path) -> None:
    path = save_tiny(
        tmp_path / "m", transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=512
    )
    check_model(path, prompts_for(320), atol=LOGIT_ATOL)


# transformers derives layer_types from these where config.json has none (it saved the tiny model's)
QWEN2_WINDOW = {"use_sliding_window": True, "sliding_window": 16, "layer_types": None}


def test_qwen2_sliding_window_off_loads(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Qwen2.5's config.json: a window, not used (use_sliding_window false)."""
    path = edited(
        tiny_model_dirs["qwen2"],
        tmp_path / "m",
        **{**QWEN2_WINDOW, "use_sliding_window": False},
        max_window_layers=0,
    )
    assert runner(path).context_length == 512


def test_qwen2_sliding_layers_match_transformers(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Layer 1 attends within 16 tokens (layer_types from use_sliding_window and max_window_layers),
    layer 0 over every key."""
    path = edited(tiny_model_dirs["qwen2"], tmp_path / "m", **QWEN2_WINDOW, max_window_layers=1)
    model = runner(path).model
    assert [layer.self_attn.attn.sliding_window for layer in model.model.local_layers] == [None, 16]
    check_model(path, prompts_for(320), atol=LOGIT_ATOL)


def test_qwen2_window_in_no_layer_loads(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """use_sliding_window with max_window_layers >= num_hidden_layers: every layer is full attention."""
    path = edited(tiny_model_dirs["qwen2"], tmp_path / "m", **QWEN2_WINDOW, max_window_layers=2)
    runner(path)


REFUSED = {
    "hidden_act": ({"hidden_act": "gelu"}, r'hidden_act="gelu" \(the MLP\'s activation; srt computes silu'),
    "yarn": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
        r'rope_type="yarn" \(in rope_parameters / rope_scaling; srt computes default, linear, llama3, longrope\)',
    ),
    "dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r'rope_type="dynamic"'),
    "partial_rotary": (
        {"partial_rotary_factor": 0.5},
        r"partial_rotary_factor=0\.5 \(rotary embedding on part of each head",
    ),
    "mlp_bias": ({"mlp_bias": True}, r"mlp_bias=true \(biases on gate_proj, up_proj and down_proj\)"),
    "softcapping": (
        {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        r"attn_logit_softcapping=50\.0 \(attention score soft-capping, tanh\(x / cap\) \* cap\), "
        r"final_logit_softcapping=30\.0 \(logit soft-capping, tanh\(x / cap\) \* cap\) are not implemented",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_llama_field_is_refused_by_name(case: str, tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    fields, message = REFUSED[case]
    path = edited(tiny_model_dirs["llama"], tmp_path / "m", **fields)
    with pytest.raises(ValueError, match=rf"^config\.json: {message}.* by srt for LlamaForCausalLM"):
        runner(path)


def test_unknown_layer_type_is_refused(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = edited(
        tiny_model_dirs["qwen3"], tmp_path / "m", layer_types=["full_attention", "chunked_attention"]
    )
    with pytest.raises(
        ValueError,
        match=r'^config\.json: layer_types=\["chunked_attention"\] \(attention kinds other than full_attention, '
        r"sliding_attention\) is not implemented by srt for Qwen3ForCausalLM",
    ):
        runner(path)


def test_fields_transformers_ignores_for_the_architecture_load(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Llama reads no sliding_window, and neither reads pretraining_tp in transformers 5; dropout is
    training only. Mistral ignores mlp_bias."""
    runner(
        edited(
            tiny_model_dirs["llama"],
            tmp_path / "llama",
            sliding_window=16,
            pretraining_tp=2,
            attention_dropout=0.1,
        )
    )
    as_mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None}
    runner(edited(tiny_model_dirs["llama"], tmp_path / "mistral", **as_mistral, mlp_bias=True))


@pytest.mark.parametrize(
    "config_cls, model_cls",
    [
        (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    ],
)
def test_attention_bias_matches_transformers(config_cls: Any, model_cls: Any, tmp_path: Path) -> None:
    """Llama and Qwen3 put a bias on q, k, v and o where attention_bias is true."""
    path = save_tiny(tmp_path / "m", config_cls, model_cls, attention_bias=True)
    check_model(path, prompts_for(320), atol=LOGIT_ATOL)


def test_a_backend_without_sliding_windows_refuses_a_windowed_model(
    mistral_window_16: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton's and flashinfer's backends have no window: a model with one is refused at start-up,
    naming the backend and the windows (here on the torch backend, marked windowless)."""
    monkeypatch.setattr(TorchNativeAttnBackend, "supports_sliding_window", False)
    with pytest.raises(
        ValueError,
        match=r"^--attention-backend torch_native has no sliding-window attention, which this model's "
        r"layers use \(windows of \[16\] tokens\)",
    ):
        ModelRunner(
            RunnerConfig(
                model_dir=mistral_window_16,
                dtype=torch.float32,
                max_total_tokens=256,
                attention_backend="torch_native",
            )
        )
