"""The tokenizer AutoTokenizer would pick, loaded without importing torch.

The main process and the detokenizer need only the tokenizer, but `AutoTokenizer` imports
transformers' model configs, which import torch (about 250 MB resident in each process). The
tokenizer classes themselves do not: this module picks the class as `AutoTokenizer.from_pretrained`
does for a local directory, from `tokenizer_config.json` and `config.json`, and loads that class
directly. tests/test_tokenizer_loader.py checks that the class (hence every id, text and chat
template) is AutoTokenizer's for each model family srt serves, and that the two tables below agree
with transformers' own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers

# The tokenizer class transformers registers for each model type srt serves (transformers'
# TOKENIZER_MAPPING_NAMES); a model type absent here registers none.
REGISTERED_TOKENIZERS: dict[str, str] = {
    "bert": "BertTokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
    "glm4": "TokenizersBackend",
    "mistral": "TokenizersBackend",
    "mixtral": "TokenizersBackend",
    "olmo2": "TokenizersBackend",
    "olmoe": "GPTNeoXTokenizer",
    "phi3": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer",
    "qwen2_moe": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
}
# Model types whose checkpoints often name the wrong class: the registered one wins
# (transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, restricted to the families above).
HUB_CLASS_OVERRIDDEN = frozenset({"phi3", "qwen2"})
_GENERIC = ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer in directory `path`, of the class AutoTokenizer.from_pretrained(path) picks."""
    return tokenizer_class(path).from_pretrained(str(path))


def tokenizer_class(path: str | Path) -> type[Any]:
    """AutoTokenizer's choice for a local directory (its remote-code and Mistral paths aside)."""
    directory = Path(path)
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    config = _read_json(directory / "config.json")
    model_type = str(config.get("model_type") or "")
    hub_class = tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
    registered = REGISTERED_TOKENIZERS.get(model_type)
    if (
        hub_class is not None
        and hub_class.removesuffix("Fast") == "LlamaTokenizer"
        and model_type not in HUB_CLASS_OVERRIDDEN
        and _byte_level(directory)
    ):
        return transformers.TokenizersBackend
    if hub_class is not None and registered is not None and registered != hub_class.removesuffix("Fast"):
        if registered not in _GENERIC:
            chosen = _class_named(registered if model_type in HUB_CLASS_OVERRIDDEN else hub_class)
            if chosen is not None and chosen.__name__ not in _GENERIC:
                return chosen
        return transformers.TokenizersBackend
    name = hub_class or registered
    if name is None:
        return transformers.TokenizersBackend
    chosen = _class_named(name.removesuffix("Fast")) or _class_named(name)
    if chosen is None or chosen.__name__ == "PythonBackend":
        return transformers.TokenizersBackend
    return chosen


def _class_named(name: str) -> type[Any] | None:
    chosen = getattr(transformers, name, None)
    return chosen if isinstance(chosen, type) else None


def _byte_level(directory: Path) -> bool:
    tokenizer_file = directory / "tokenizer.json"
    return tokenizer_file.is_file() and '"ByteLevel"' in tokenizer_file.read_text(encoding="utf-8")


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    loaded = json.loads(file.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else {}
