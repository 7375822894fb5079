"""Write docs/server_args.md, the flag reference, from the flags launch_server parses.

The parser is built as launch_server builds it (`srt.cli_args.add_cli_args`); each flag's default,
values and help text (every flag has one) come from its argparse action, its topic from `CLI_FLAGS`
in srt/cli_flags.py.

    python scripts/gen_server_args_doc.py           # write docs/server_args.md
    python scripts/gen_server_args_doc.py --check   # exit 1 if the page differs from what this writes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from srt.cli_args import add_cli_args  # noqa: E402
from srt.cli_flags import CLI_FLAGS  # noqa: E402
from srt.server_args import ENV_DEFAULTS  # noqa: E402

DOC = ROOT / "docs" / "server_args.md"
COMMAND = "python scripts/gen_server_args_doc.py"

HEADER = f"""# Server flags

Every flag of `launch_server`, by topic: its default, the values it takes and what it does. Each
flag sets the `ServerArgs` field of the same name (`--tp-size` sets `tp_size`); the values are
checked once at start-up, and a bad one fails naming its flag. `launch_server --help` lists the
same flags in the same order. Where a default names an environment variable, that variable gives
the value when the flag is not given.

Generated from `srt/cli_args.py` and `srt/server_args.py` by `{COMMAND}`: do not edit this page
by hand; `tests/test_docs.py` fails when it differs from what the script writes.
"""


def _cell(text: str) -> str:
    """Text as a table cell: `|` would end the cell, `<` open an HTML tag, `*` start emphasis."""
    for char, escaped in (("|", "\\|"), ("<", "&lt;"), ("*", "\\*")):
        text = text.replace(char, escaped)
    return text.strip()


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        text = "off"
    elif action.default is None:
        text = "none"
    else:
        text = f"`{action.default}`"
    env = ENV_DEFAULTS.get(action.dest)
    return f"{text}, or `{env}`" if env else text


def _values(action: argparse.Action) -> str:
    if action.choices is not None:
        return ", ".join(f"`{choice}`" for choice in action.choices)
    if isinstance(action, argparse._StoreTrueAction):
        return "switch"
    return {int: "integer", float: "number"}.get(action.type, "text")  # type: ignore[call-overload]


def _row(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    return f"| {names} | {_cell(_default(action))} | {_values(action)} | {_cell(action.help or '')} |"


def render() -> str:
    """The page as this tree's parser defines the flags."""
    parser = argparse.ArgumentParser(prog="launch_server", add_help=False)
    add_cli_args(parser)
    actions = {action.option_strings[0]: action for action in parser._actions}  # built from CLI_FLAGS
    parts = [HEADER, "Topics: " + ", ".join(f"[{g.title}](#{anchor(g.title)})" for g in CLI_FLAGS) + ".\n"]
    for group in CLI_FLAGS:
        pages = " and ".join(f"[{page}]({page})" for page in group.pages)
        rows = [_row(actions[flag.names[0]]) for flag in group.flags]
        parts.append(
            f"## {group.title}\n\nMore in {pages}.\n\n"
            "| flag | default | values | what it does |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
        )
    return "\n".join(parts)


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, spaces to dashes, punctuation dropped."""
    kept = "".join(c for c in title.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale; write nothing")
    parser.add_argument("--out", type=Path, default=DOC, help=f"the page (default: {DOC.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else None
        if current != page:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
