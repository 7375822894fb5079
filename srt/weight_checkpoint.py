"""Whether a folder can replace the running model's weights (/update_weights_from_disk): a folder of
safetensors files whose config.json is the running model's, but for the fields that name or date the
checkpoint. Read from json alone, so the front end refuses a bad path with a 400 before any rank
reads a tensor, and every rank checks again before it loads (the folder may change in between).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# config.json fields that say where or when a checkpoint was written, not what it computes
IGNORED_FIELDS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})


def _config(folder: Path, what: str) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{what} {str(folder)!r} has no readable config.json: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what} {str(folder)!r}: config.json is not an object")
    return {k: v for k, v in config.items() if k not in IGNORED_FIELDS}


def check_checkpoint(model_path: str | Path, running: str | Path, load_format: str | None = None) -> None:
    """ValueError naming `model_path` unless it is a safetensors folder of the running model's
    architecture and config (`running`: the folder the server serves now)."""
    folder = Path(model_path)
    if folder.suffix == ".gguf" or load_format == "gguf":
        raise ValueError(
            f"model_path {str(model_path)!r} is a GGUF file: weights update from a safetensors folder"
        )
    if not folder.is_dir():
        raise ValueError(f"model_path {str(model_path)!r} is not a folder")
    if load_format not in (None, "auto", "safetensors"):
        raise ValueError(f"load_format {load_format!r}: srt updates weights from safetensors folders only")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model_path {str(model_path)!r} holds no .safetensors file")
    running_dir = Path(running)
    if not running_dir.is_dir():
        raise ValueError("the server runs a GGUF file: its weights update from no folder")
    new, old = _config(folder, "model_path"), _config(running_dir, "the running model's folder")
    if new.get("architectures") != old.get("architectures"):
        raise ValueError(
            f"model_path {str(model_path)!r} is a {new.get('architectures')} checkpoint; "
            f"the server runs {old.get('architectures')}"
        )
    differ = sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))
    if differ:
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ[:4])
        raise ValueError(
            f"model_path {str(model_path)!r} has another config than the running model's ({shown})"
        )
