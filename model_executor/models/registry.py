"""Model classes keyed by the `architectures` field of a transformers config."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from model_executor.models.base import CausalLM

_MODELS: dict[str, type[CausalLM]] = {}
_MODEL_MODULES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "moe",
    "gemma",
    "phi3",
    "olmo2",
    "glm4",
    "bert",
)  # each registers its classes on import


def register_model(*architectures: str) -> Callable[[type[CausalLM]], type[CausalLM]]:
    def wrap(cls: type[CausalLM]) -> type[CausalLM]:
        for name in architectures:
            _MODELS[name] = cls
        return cls

    return wrap


def supported_architectures() -> list[str]:
    _import_all()
    return sorted(_MODELS)


def get_model_class(config: Any) -> type[CausalLM]:
    _import_all()
    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(
        f"unknown model architecture {architectures or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(_MODELS))}"
    )


def _import_all() -> None:
    for module in _MODEL_MODULES:
        importlib.import_module(f"model_executor.models.{module}")
