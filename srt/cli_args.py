"""The launch_server command line: the parser built from the flag table (srt/cli_flags.py) and
ServerArgs parsed from argv. `--help` adds each flag's default where it has one."""

from __future__ import annotations

import argparse

from srt.cli_flags import CLI_FLAGS
from srt.server_args import ServerArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of CLI_FLAGS, in its order (the flat list `launch_server --help` prints)."""
    for group in CLI_FLAGS:
        for flag in group.flags:
            parser.add_argument(*flag.names, **flag.options)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, less its "(default: None)" and "(default: False)":
    a switch is off unless given, and a flag whose default is None says what None means itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return help_text
        if "%(default)" in help_text:
            return help_text
        return help_text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """launch_server's parser: what `--help` prints and what parse_server_args parses."""
    parser = argparse.ArgumentParser(
        prog="launch_server", description="srt inference server", formatter_class=DefaultsHelpFormatter
    )
    add_cli_args(parser)
    return parser


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    ns = vars(build_parser().parse_args(argv))
    ns = {k: v for k, v in ns.items() if v is not None or k in ("model_path",)}
    if ns.get("cpu_kvcache_space") is not None and ns.get("device") != "cpu":
        raise ValueError(
            "--cpu-kvcache-space sizes the KV cache on --device cpu; on CUDA use "
            "--mem-fraction-static or --max-total-tokens"
        )
    for name in ("cuda_graph_bs", "lora_paths", "lora_target_modules"):
        if ns.get(name) is not None:
            ns[name] = tuple(ns[name])
    return ServerArgs(**ns)
