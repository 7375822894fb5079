"""Convert a GGUF checkpoint, once, into a cached Hugging Face directory.

The result holds `config.json`, `generation_config.json`, `model.safetensors` (the dequantised
tensors in float32 under HF names) and the tokenizer files, so the rest of the loader only ever
reads HF directories. Conversions are cached under `<cache>/gguf/<stem>-<hash>`; several processes
(tensor-parallel ranks) may ask at once: one converts under a file lock into a temporary folder
and renames it into place, the others wait and reuse it.
torch is imported only to convert: a process that finds the conversion cached imports none.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("srt.loader")

CACHE_DIR_ENV = "SRT_CACHE_DIR"
COMPLETE_MARKER = ".srt-complete.json"
# Part of the cache key: bump it when the converted layout changes so stale caches are not reused.
FORMAT_VERSION = 1
_GGUF_MAGIC = b"GGUF"


def default_cache_dir() -> Path:
    """`$SRT_CACHE_DIR`, else `~/.cache/srt`."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "srt").expanduser()


def converted_dir_for(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The directory `convert_gguf` uses for this file; it changes when the file is moved or rewritten."""
    source = _check_gguf_file(gguf_path)
    stat = source.stat()
    key = f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root.resolve() / "gguf" / f"{source.stem}-{digest}"


def convert_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Return an HF-style directory holding the converted `gguf_path`, converting it on first use.

    Safe to call from several processes at once: nobody ever sees a half-written directory.
    Raises ValueError when `gguf_path` is not a readable GGUF file.
    """
    source = _check_gguf_file(gguf_path)
    target = converted_dir_for(source, cache_dir)
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f"{target.name}.lock"):
        if (target / COMPLETE_MARKER).is_file():  # another process finished while we waited
            return target
        _remove_leftovers(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.monotonic()
            logger.info("Converting %s into %s (one-time)", source, target)
            _convert_into(source, staging)
            marker = {"source": str(source), "format_version": FORMAT_VERSION, "created": time.time()}
            (staging / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2))
            _make_readable(staging)
            os.rename(staging, target)
            logger.info("Converted %s in %.1f s", source.name, time.monotonic() - started)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file `model_dir` was converted from (convert_gguf's marker names it), or None: not a
    conversion, or the file is gone."""
    marker = Path(model_dir) / COMPLETE_MARKER
    try:
        source = Path(json.loads(marker.read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None


def _check_gguf_file(gguf_path: str | Path) -> Path:
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"gguf_path {str(gguf_path)!r} does not exist or is not a file")
    with path.open("rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ValueError(f"gguf_path {str(gguf_path)!r} is not a GGUF file (bad magic {magic!r})")
    return path


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # The lock file stays behind on purpose: unlinking it would let two processes lock different inodes.
    with lock_path.open("a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process to finish converting (lock %s)", lock_path)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    # mkdtemp (and safetensors) create owner-only modes; the cache may be shared by several users.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _remove_leftovers(target: Path) -> None:
    """Under the lock: drop staging folders of crashed conversions, and an unmarked target."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        logger.warning("Removing leftover of an interrupted conversion: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        logger.warning("Removing incomplete conversion %s", target)
        shutil.rmtree(target)


def _convert_into(source: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    started = time.monotonic()
    config = AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name)
    # transformers keeps GGUF's `general.name` under this key; it is not a real config field.
    if hasattr(config, "_model_name_or_path"):
        delattr(config, "_model_name_or_path")
    _fill_moe_fields(source, config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    logger.info(
        "Read the config of %s (%s) in %.1f s",
        source.name,
        config.architectures[0],
        time.monotonic() - started,
    )

    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    tensors = _split_experts(_dequantize(source, config.to_dict(), expected))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    # The GGUF tokenizer comes with an "unlimited" length; the model's context is the real one.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


# llama.cpp's Qwen MoE fields that transformers' GGUF config mapping leaves at its defaults: the
# expert's (and shared expert's) intermediate sizes, and whether the top-k weights are renormalized
# (llama.cpp's qwen3moe graph always does, its qwen2moe graph never does).
_MOE_FIELDS = {
    "qwen3moe": ({"expert_feed_forward_length": "moe_intermediate_size"}, True),
    "qwen2moe": (
        {
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
        },
        False,
    ),
}


def _fill_moe_fields(source: Path, config: Any) -> None:
    import gguf
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = gguf.GGUFReader(str(source))
    architecture = read_field(reader, "general.architecture")[0]
    if architecture not in _MOE_FIELDS:
        return
    fields, renormalize = _MOE_FIELDS[architecture]
    for key, attribute in fields.items():
        value = read_field(reader, f"{architecture}.{key}")
        if value:
            setattr(config, attribute, int(value[0]))
    config.norm_topk_prob = renormalize


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
    [E, H, I]) under the per-expert names of a Hugging Face checkpoint on disk, which the loader reads."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, kind = name.rpartition(".experts.")
        if kind == "gate_up_proj" and tensor.dim() == 3:
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.experts.{e}.up_proj.weight"] = up[e].contiguous()
        elif kind == "down_proj" and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return out


def _dequantize(
    source: Path, config: dict[str, Any], expected: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Every GGUF tensor as float32 under its HF name, undoing llama.cpp's layout changes (q/k rows).

    Mirrors transformers' `load_gguf_checkpoint`, but parses the file and builds the name map once
    (transformers rebuilds it per submodule, which costs more than the dequantisation itself).
    """
    import gguf
    import numpy as np
    import torch
    from tqdm import tqdm
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    reader = gguf.GGUFReader(str(source))
    architecture = read_field(reader, "general.architecture")[0]
    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture), None)
    if arch_id is None:
        raise ValueError(f"gguf_path {str(source)!r}: architecture {architecture!r} is unknown to gguf-py")
    name_map = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    gguf_to_hf: dict[str, str] = {}
    for hf_name in expected:  # as transformers' get_gguf_hf_weights_map names them
        name, suffix = processor.preprocess_name(hf_name), ""
        if name.endswith((".weight", ".bias")):
            name, suffix = name.rsplit(".", 1)
            suffix = "." + suffix
        gguf_name = name_map.get_name(name)
        if gguf_name is None:  # MoE experts' stacked gate and up: both into gate_up_proj
            processor.perform_fallback_tensor_mapping(gguf_to_hf, suffix, "", hf_name)
        else:
            gguf_to_hf[gguf_name + suffix] = hf_name

    parsed: dict[str, Any] = {"config": config, "tensors": {}}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"Dequantizing {source.name}", unit="tensor", disable=None):
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=values, name=tensor.name, tensor_key_mapping=gguf_to_hf, parsed_parameters=parsed
        )
        if result.name not in gguf_to_hf:
            logger.debug("GGUF tensor %s has no HF counterpart; skipped", tensor.name)
            continue
        tensors[gguf_to_hf[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))
    for name, extra in parsed["tensors"].items():  # tensors a processor merged itself (MoE experts)
        if name in expected:
            tensors[name] = extra.to(torch.float32).contiguous()

    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(
            f"gguf_path {str(source)!r} ({architecture}) lacks tensors the model needs, "
            f"e.g. {missing[:3]} ({len(missing)} in all); this architecture is not supported"
        )
    for name, values_t in tensors.items():
        if tuple(values_t.shape) != expected[name]:
            raise ValueError(
                f"gguf_path {str(source)!r}: tensor {name} has shape {tuple(values_t.shape)}, "
                f"the model expects {expected[name]}"
            )
    return tensors
