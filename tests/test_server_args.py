"""ServerArgs parsing and validation: errors name the flag."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from srt.cli_args import build_parser, parse_server_args
from srt.server_args import ServerArgs


def test_sglang_flag_names_and_aliases() -> None:
    args = parse_server_args(
        [
            "--tp",
            "2",
            "--pp-size",
            "1",
            "--port",
            "31000",
            "--max-total-tokens",
            "4096",
            "--schedule-policy",
            "lpm",
            "--disable-radix-cache",
            "--page-size",
            "4",
        ]
    )
    assert (args.tp_size, args.port, args.max_total_tokens, args.schedule_policy) == (2, 31000, 4096, "lpm")
    assert args.disable_radix_cache and args.page_size == 4 and args.world_size == 2


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--tp-size", "0"], "--tp-size"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "127.0.0.1:5000"], "--nnodes"),
        (["--nnodes", "2", "--tp", "2"], "--dist-init-addr"),
        (["--port", "70000"], "--port"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--watchdog-timeout", "0"], "--watchdog-timeout"),
        (["--cpu-kvcache-space", "0"], "--cpu-kvcache-space"),
        (["--cpu-kvcache-space", "2", "--device", "cuda"], "--cpu-kvcache-space"),
        (["--min-available-memory", "-1"], "--min-available-memory"),
        (["--cpu-threads", "0"], "--cpu-threads"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        parse_server_args(argv)


def test_deterministic_inference_is_asked_for_or_needed_by_restarts() -> None:
    assert not parse_server_args([]).deterministic
    assert parse_server_args(["--enable-deterministic-inference"]).deterministic
    assert parse_server_args(
        ["--restart-on-failure", "2"]
    ).deterministic  # its replays re-prefill decoded tokens
    assert not parse_server_args(["--restart-on-failure", "2", "--quantization", "gguf"]).deterministic
    with pytest.raises(
        ValueError, match="--enable-deterministic-inference cannot hold with --quantization gguf"
    ):
        parse_server_args(["--enable-deterministic-inference", "--quantization", "gguf"])


def test_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNC_TOKEN_IDS_ACROSS_TP", "1")
    monkeypatch.setenv("SRT_ENABLE_RANK_CONSENSUS_CHECKER", "true")
    args = parse_server_args([])
    assert args.sync_token_ids_across_tp and args.enable_rank_consensus_checker
    with pytest.raises(dataclass_error()):
        args.port = 1  # type: ignore[misc]


def dataclass_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_the_api_names_the_model_as_given() -> None:
    assert ServerArgs().model_name == "SmolLM2-135M-Instruct"  # the bundled model, not its cache folder
    assert ServerArgs(model_path="/models/x.gguf").model_name == "/models/x.gguf"  # SGLang's default
    assert ServerArgs(model_path="/models/x", served_model_name="x-chat").model_name == "x-chat"


def test_request_deadlines_from_sglang_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_server_args([]).req_waiting_timeout is None  # off by default, as SGLang's -1
    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "30")
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", "-1")
    args = parse_server_args([])
    assert args.req_waiting_timeout == 30.0 and args.req_running_timeout is None
    assert parse_server_args(["--req-running-timeout", "5"]).req_running_timeout == 5.0
    with pytest.raises(ValueError, match="--req-waiting-timeout"):
        parse_server_args(["--req-waiting-timeout", "0"])


def test_kv_space_flag_and_vllm_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_server_args([])
    assert args.cpu_kvcache_space is None and args.mem_fraction_static is None and args.uses_cpu_kvcache_space
    assert parse_server_args(["--cpu-kvcache-space", "0.5"]).cpu_kvcache_space == 0.5
    assert not parse_server_args(["--max-total-tokens", "4096"]).uses_cpu_kvcache_space  # SGLang's flag alone
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert parse_server_args([]).cpu_kvcache_space == 8.0
    assert parse_server_args(["--cpu-kvcache-space", "2"]).cpu_kvcache_space == 2.0  # the flag wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM's "unset"
    assert parse_server_args([]).cpu_kvcache_space is None


def test_cpu_threads_flag_and_sglang_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    assert parse_server_args([]).cpu_threads is None  # the usable CPUs divided by this node's ranks
    args = parse_server_args(["--cpu-threads", "3", "--dp-size", "2"])
    argv = args.to_cli(dp_size=1)  # a replica's: its ranks take 3 threads each too
    assert args.cpu_threads == 3 and argv[argv.index("--cpu-threads") + 1] == "3"
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-1|2-3")
    with pytest.raises(ValueError, match="SGLANG_CPU_OMP_THREADS_BIND pins the ranks of one replica"):
        parse_server_args(["--dp-size", "2"])


def test_every_flag_has_help_and_a_flag_without_a_default_says_what_none_means() -> None:
    flags = [action for action in build_parser()._actions if action.option_strings and action.dest != "help"]
    assert len(flags) > 60
    no_help = [action.option_strings[0] for action in flags if not (action.help or "").strip()]
    assert not no_help, f"flags without a help text: {no_help}"
    unexplained = [
        action.option_strings[0]
        for action in flags
        if action.default is None and "default" not in action.help
    ]
    assert not unexplained, (
        f"flags whose default is None and whose help does not say what None means: {unexplained}"
    )


def test_help_shows_the_defaults() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert shown.returncode == 0, shown.stderr
    entries = {
        match.group(1): " ".join(match.group(2).split())
        for match in re.finditer(r"^  (--[\w-]+)(.*?)(?=^  -|\Z)", shown.stdout, flags=re.S | re.M)
    }
    assert entries["--port"].endswith(
        "the port of the HTTP server (with --dp-size > 1, the router's) (default: 30000)"
    )
    assert entries["--schedule-policy"].endswith("(default: fcfs)")
    assert "(default: None)" not in shown.stdout and "(default: False)" not in shown.stdout
