"""Compare srt/request_fields.py with the request schemas of an installed sglang, to update the lists.

    python -m venv /tmp/sgl && /tmp/sgl/bin/pip install --no-deps sglang   # SGLang's Python files only
    python scripts/check_request_fields.py --sglang /tmp/sgl/lib/python3.11/site-packages/sglang

Prints, per schema, the fields that sglang has and srt's list lacks (add them: implement, `off`
with SGLang's default, or `advisory`) and the ones srt lists that sglang no longer has (keep them
while clients may still send them). Reads sglang's source with `ast`; nothing of it is imported.
Exit status 1 when sglang has fields srt's lists lack.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPTS.parent))

from srt.request_fields import CHAT, COMPLETION, GENERATE, SAMPLING, SOURCES  # noqa: E402

# (srt's list, sglang file, class names whose annotated fields make up the schema)
SCHEMAS = {
    "GenerateReqInput": (GENERATE, "srt/managers/io_struct.py", ("GenerateReqInput",)),
    "SamplingParams": (SAMPLING, "srt/sampling/sampling_params.py", ("SamplingParams",)),
    "CompletionRequest": (
        COMPLETION,
        "srt/entrypoints/openai/protocol.py",
        ("CompletionRequest", "PDRoutingFields"),
    ),
    "ChatCompletionRequest": (
        CHAT,
        "srt/entrypoints/openai/protocol.py",
        ("ChatCompletionRequest", "PDRoutingFields"),
    ),
}
# SamplingParams fields SGLang fills in itself (not API input)
INTERNAL = {
    "stop_strs",
    "stop_regex_strs",
    "stop_str_max_len",
    "stop_regex_max_len",
    "is_normalized",
    "ebnf_full_assistant",
}


def fields_of(path: Path, classes: tuple[str, ...]) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and not item.target.id.startswith("_")
                ):
                    names.add(item.target.id)
    return names - INTERNAL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang", type=Path, required=True, help="the installed sglang package directory")
    args = parser.parse_args(argv)
    print(f"srt's lists come from: {SOURCES}")
    missing_any = False
    for schema, (vocabulary, relative, classes) in SCHEMAS.items():
        path = args.sglang / relative
        if not path.is_file():
            print(f"{schema}: {path} not found", file=sys.stderr)
            return 2
        theirs = fields_of(path, classes)
        missing, gone = sorted(theirs - set(vocabulary)), sorted(set(vocabulary) - theirs)
        missing_any |= bool(missing)
        print(
            f"{schema}: {len(theirs)} fields in sglang; missing from srt's list: {', '.join(missing) or 'none'}; "
            f"in srt's list only: {', '.join(gone) or 'none'}"
        )
    return 1 if missing_any else 0


if __name__ == "__main__":
    sys.exit(main())
