from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "llama_mqa", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from model_executor.loader.weight_source import resolve_model_path

    return resolve_model_path(None)
