"""`--model-path` resolved to a Hugging Face model directory, without importing torch: the main
process resolves it before starting the ranks (converting a GGUF file imports torch, once; a
conversion already cached does not)."""

from __future__ import annotations

from pathlib import Path

from model_executor.loader.gguf_convert import convert_gguf
from srt.default_model import default_model_path


def resolve_model_path(model_path: str | None, flag: str = "--model-path") -> Path:
    """Turn `--model-path` into an HF-style model directory.

    None means the default model; a `.gguf` file is converted (once, cached); a directory must
    hold a `config.json`. Raises ValueError naming `flag` for anything else.
    """
    if model_path is None:
        return convert_gguf(default_model_path())
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ValueError(
            f"{flag} {model_path!r} does not exist (downloading from a model hub is not supported: "
            f"pass a local model directory or a .gguf file)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{flag} {model_path!r} is a file but not a .gguf file")
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{flag} {model_path!r} is a directory with no config.json")
    return path.resolve()
