"""Loader errors name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_executor.loader.weight_source import LazyTensor
from model_executor.model_runner import ModelRunner, RunnerConfig


def copy_model(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def runner(path: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=path, dtype=torch.float32, max_total_tokens=256))


def test_missing_tensor(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(
        tiny_model_dirs["llama"], tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight \(shards \['k'\]\)"):
        runner(path)


def test_unused_tensor(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(
        tiny_model_dirs["llama"],
        tmp_path / "m",
        lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}),
    )
    with pytest.raises(ValueError, match=r"not used by the model: model\.layers\.0\.mystery\.weight"):
        runner(path)


def test_wrong_shape(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][
            :, :100
        ].contiguous()

    path = copy_model(tiny_model_dirs["llama"], tmp_path / "m", shrink)
    with pytest.raises(
        ValueError,
        match=r"shape mismatch: checkpoint tensor 'model\.layers\.0\.mlp\.down_proj\.weight' of shape \(64, 100\)",
    ):
        runner(path)


def test_unknown_architecture(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(tiny_model_dirs["llama"], tmp_path / "m", lambda t: None)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"unknown model architecture \['FancyNewForCausalLM'\].*LlamaForCausalLM"
    ):
        runner(path)


def test_packed_and_sharded_loading_reads_the_right_rows() -> None:
    """A 2-rank QKV layer built in one process: rank 1 gets the second half of q and of k/v."""
    from model_executor.distributed.communicator import Communicator
    from model_executor.layers.linear import QKVParallelLinear

    comm = Communicator(ranks=[0, 1], rank_in_group=1)
    layer = QKVParallelLinear(8, 2, num_heads=4, num_kv_heads=2, bias=False, comm=comm)
    q = torch.arange(8 * 8, dtype=torch.float32).view(8, 8)
    k = -torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    v = k * 10
    for name, t in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, LazyTensor.from_tensor(name, t), name)  # type: ignore[attr-defined]
    assert torch.equal(layer.weight[:4], q[4:])
    assert torch.equal(layer.weight[4:6], k[2:])
    assert torch.equal(layer.weight[6:], v[2:])
    with pytest.raises(ValueError, match="not divisible"):
        QKVParallelLinear(8, 2, num_heads=3, num_kv_heads=1, bias=False, comm=comm)
