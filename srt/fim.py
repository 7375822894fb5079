"""Fill-in-the-middle (FIM) prompts for code models: the text before a gap and the text after it
become the token ids a code model was trained to complete the gap from.

The model's FIM tokens are found once per tokenizer by their text, as llama.cpp finds them:
Qwen2.5-Coder's `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>` (and `<|repo_name|>`,
`<|file_sep|>` for repo-level FIM), StarCoder's and SmolLM's `<fim_prefix>`..., CodeLlama's
`▁<PRE>`.... The prompt is built from ids, never from a string with the tokens spelled out, so code
that happens to contain `<|fim_middle|>` stays text:

    [bos] FIM_PRE prefix FIM_SUF suffix FIM_MID          fim_prompt (suffix on /v1/completions)

and llama.cpp's /infill layout (its `format_infill`, without the trimming to its batch size):

    FIM_REP "myproject\\n" (FIM_SEP filename "\\n" text)... FIM_SEP "filename\\n"
    [bos] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID  infill_prompt

where a tokenizer without FIM_REP / FIM_SEP gets "\\n\\n--- snippet ---\\n\\n" before each extra chunk
instead. `[bos]` is whatever the tokenizer puts before every text (nothing for Qwen).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from srt.generate_parse import RequestError

# Candidate spellings, in llama.cpp's order of preference (llama-vocab.cpp).
_PREFIX = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>")
_SUFFIX = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>")
_MIDDLE = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>")
_REPO = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>")
_FILE_SEP = ("<|file_sep|>",)
# Where a FIM completion ends besides the model's EOS (llama.cpp's end-of-generation tokens): a
# code model closes the middle with end-of-text, or starts the next file or repository.
_ENDS = ("<|endoftext|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<EOT>", "▁<EOT>")
_SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class ExtraChunk:
    """One piece of /infill's `input_extra`: another file's text, for repo-level context."""

    text: str
    filename: str = "tmp"


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None  # repo-level FIM: the repository's name follows
    file_sep: int | None  # repo-level FIM: a file's name and text follow
    bos: tuple[int, ...]  # what the tokenizer puts before every text
    end_ids: tuple[int, ...]  # tokens that end a FIM completion (besides the model's EOS)


def _token_id(vocab: dict[str, int], names: tuple[str, ...]) -> int | None:
    return next((vocab[name] for name in names if name in vocab), None)


@lru_cache(maxsize=8)
def find_fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The tokenizer's FIM tokens, or None when it lacks a prefix, suffix or middle token."""
    vocab = tokenizer.get_vocab()
    prefix, suffix, middle = (_token_id(vocab, names) for names in (_PREFIX, _SUFFIX, _MIDDLE))
    if prefix is None or suffix is None or middle is None:
        return None
    repo, file_sep = _token_id(vocab, _REPO), _token_id(vocab, _FILE_SEP)
    with_special = list(tokenizer("a")["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    bos = tuple(with_special[: with_special.index(plain[0])]) if plain and plain[0] in with_special else ()
    ends = [vocab[name] for name in _ENDS if name in vocab] + [t for t in (repo, file_sep) if t is not None]
    return FimTokens(prefix, suffix, middle, repo, file_sep, bos, tuple(dict.fromkeys(ends)))


def require_fim_tokens(tokenizer: Any, param: str, asked_by: str | None = None) -> FimTokens:
    """The FIM tokens; RequestError naming `param` (and `asked_by`, the route or field that needs
    them) when the model has none."""
    fim = find_fim_tokens(tokenizer)
    if fim is None:
        raise RequestError(
            f"{asked_by or param} needs fill-in-the-middle, and this model has no fill-in-the-middle tokens "
            f"(no {_PREFIX[0]}, {_PREFIX[2]} or {_PREFIX[4]} in its tokenizer): serve a code model "
            "trained for it, such as Qwen2.5-Coder",
            param,
        )
    return fim


def check_text(value: Any, param: str) -> str:
    """`value` if it is a string a tokenizer can take; RequestError naming `param` otherwise."""
    if not isinstance(value, str):
        raise RequestError(f"{param} must be a string, got {type(value).__name__}", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{param} contains an unpaired surrogate (not valid Unicode)", param) from None
    return value


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` (checked by check_text) as plain text: no BOS, and special-token spellings in it stay
    text (llama.cpp's parse_special=false for the prefix, suffix and extra chunks)."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def fim_prompt(fim: FimTokens, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
    return [*fim.bos, fim.prefix, *prefix_ids, fim.suffix, *suffix_ids, fim.middle]


def _extra_ids(tokenizer: Any, fim: FimTokens, extra: list[ExtraChunk]) -> list[int]:
    ids = [] if fim.repo is None else [fim.repo, *text_ids(tokenizer, "myproject\n")]
    for chunk in extra:
        if fim.file_sep is None:
            ids += text_ids(tokenizer, _SNIPPET_SEPARATOR)
        else:
            ids += [fim.file_sep, *text_ids(tokenizer, chunk.filename + "\n")]
        ids += text_ids(tokenizer, chunk.text)
    if fim.file_sep is not None:
        ids += [fim.file_sep, *text_ids(tokenizer, "filename\n")]
    return ids


def infill_prompt(
    tokenizer: Any, fim: FimTokens, prefix: str, suffix: str, extra: list[ExtraChunk], prompt: str = ""
) -> list[int]:
    """llama.cpp's /infill prompt: the extra chunks, then the FIM prompt with `prompt` after the
    prefix (its special-token spellings are parsed, as llama.cpp's)."""
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else []
    middle = fim_prompt(fim, text_ids(tokenizer, prefix) + prompt_ids, text_ids(tokenizer, suffix))
    return _extra_ids(tokenizer, fim, extra) + middle
