"""scripts/compare_peers.py: the ratio arithmetic, the static-batch padding, which model a running
server (--url) is compared on, and one real run on a tiny model with its own srt server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compare_peers.py"
sys.path.insert(0, str(SCRIPT.parent))  # scripts/ is not a package

import bench_clients  # noqa: E402
import bench_metrics  # noqa: E402
import compare_peers  # noqa: E402
import transformers_peer  # noqa: E402

RATIO = r"\d+\.\d\dx"
WORKLOAD = ["--num-prompts", "3", "--input-len", "12", "--output-len", "5", "--request-timeout", "60"]


def test_ratio_is_above_one_when_srt_is_better() -> None:
    assert compare_peers.ratio(300.0, 100.0, higher_is_better=True) == pytest.approx(3.0)  # throughput
    assert compare_peers.ratio(50.0, 100.0, higher_is_better=False) == pytest.approx(2.0)  # latency
    assert compare_peers.ratio(None, 100.0, True) is None and compare_peers.ratio(1.0, 0.0, False) is None


def test_report_lines_name_the_peer_metric_and_level() -> None:
    def level(latency: float, tokens: int) -> bench_metrics.LevelResult:
        result = bench_metrics.RequestResult(
            prompt_len=4,
            output_len=tokens,
            success=True,
            latency=latency,
            chunk_times=[latency / 2, latency],
            chunk_tokens=[1, tokens - 1],
        )
        return bench_metrics.LevelResult(2, bench_metrics.compute_metrics([result], 1.0), [result])

    srt, peer = level(0.1, 8), level(0.3, 4)
    lines = compare_peers.ratio_lines(2, srt.metrics, "transformers generate", peer.metrics)
    assert lines[:2] == [
        "ratio vs transformers generate (request throughput, 2 concurrent): 1.00x",
        "ratio vs transformers generate (output tok/s, 2 concurrent): 2.00x",
    ]
    assert "ratio vs transformers generate (E2E p50, 2 concurrent): 3.00x" in lines
    table = compare_peers.format_level(2, {"srt": srt, "transformers generate": peer}, "tiny")
    assert re.search(r"^output tok/s\s+8\.00\s+4\.00$", table, re.MULTILINE), table
    assert re.search(r"^E2E p50 \(ms\)\s+100\.00\s+300\.00$", table, re.MULTILINE), table


def test_rounds_report_each_ratio_median_with_the_rounds_values() -> None:
    def metrics(duration: float, latency: float) -> bench_metrics.BenchMetrics:
        result = bench_metrics.RequestResult(
            prompt_len=4,
            output_len=8,
            success=True,
            latency=latency,
            chunk_times=[latency / 2, latency],
            chunk_tokens=[1, 7],
        )
        return bench_metrics.compute_metrics([result], duration)

    peer = metrics(1.0, 0.3)
    pairs = [(metrics(0.5, 0.1), peer), (metrics(0.25, 0.1), peer), (metrics(1 / 3, 0.1), peer)]  # 2x, 4x, 3x
    per_round = compare_peers.round_ratios(pairs)
    assert per_round["output tok/s"] == pytest.approx([2.0, 4.0, 3.0])
    assert compare_peers.median_ratio(per_round["output tok/s"]) == pytest.approx(3.0)
    assert compare_peers.median_ratio([2.0, None]) is None and compare_peers.median_ratio([]) is None
    lines = compare_peers.median_ratio_lines(32, "transformers generate", pairs)
    assert (
        "ratio vs transformers generate (output tok/s, 32 concurrent): 3.00x (median of 3 rounds: 2.00x, 4.00x, "
        "3.00x)" in lines
    )
    assert (
        "ratio vs transformers generate (E2E p50, 32 concurrent): 3.00x (median of 3 rounds: 3.00x, 3.00x, "
        "3.00x)" in lines
    )


def test_each_round_gets_fresh_prompts_and_round_one_the_seed_s() -> None:
    args = compare_peers.parse_args(
        ["--num-prompts", "4", "--input-len", "6", "--concurrency", "2", "4", "--seed", "7"]
    )
    first, second = (compare_peers.make_workloads(args, 320, r) for r in (0, 1))
    assert first == compare_peers.make_workloads(args, 320)  # round 1 is the run without --rounds
    seen = [set(map(tuple, w.prompts)) for w in (*first.values(), *second.values())]
    assert all(len(p) == 4 for p in seen) and len(set().union(*seen)) == 16  # fresh for every level and round
    with pytest.raises(SystemExit):
        compare_peers.parse_args(["--rounds", "0"])


def test_left_pad_puts_every_prompt_last_token_in_the_last_column() -> None:
    ids, mask = transformers_peer.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_generate_batch_makes_exact_lengths_and_shares_batch_timings(
    tiny_model_dirs: dict[str, Path],
) -> None:
    model = transformers_peer.load_model(str(tiny_model_dirs["llama"]), torch.float32)
    results = transformers_peer.generate_batch(model, [[11, 12, 13], [14]], output_len=4)
    assert [(r.prompt_len, r.output_len, r.success) for r in results] == [(3, 4, True), (1, 4, True)]
    assert results[0].chunk_times == results[1].chunk_times and len(results[0].chunk_times) == 4
    assert (
        results[0].chunk_times == sorted(results[0].chunk_times)
        and results[0].latency >= results[0].chunk_times[-1]
    )


def check_ratio_lines(out: str, peers: list[str], levels: list[int]) -> None:
    for peer in peers:
        for level in levels:
            for _, name, _, _ in compare_peers.METRICS:
                line = rf"^ratio vs {peer} \({re.escape(name)}, {level} concurrent\): {RATIO}$"
                assert re.search(line, out, re.MULTILINE), f"no line {line!r} in:\n{out}"


@pytest.mark.slow  # its parts (peer, ratio lines, --url) are tested above; the whole run costs ~25 s
@pytest.mark.timeout(240)
def test_compare_peers_starts_its_own_server_and_prints_ratios(
    tiny_model_dirs: dict[str, Path], smollm2_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            str(tiny_model_dirs["llama"]),
            "--tokenizer-path",
            str(smollm2_dir),
            *WORKLOAD,
            "--concurrency",
            "1",
            "3",
            "--dtype",
            "float32",
            "--server-args",
            "--max-total-tokens 4096",
            "--json",
            "out.json",
        ],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    check_ratio_lines(out, ["transformers generate", "transformers continuous batching"], [1, 3])
    assert re.search(
        r"^metric\s+srt\s+transformers generate\s+transformers continuous batching$", out, re.MULTILINE
    )
    report = json.loads((tmp_path / "out.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        for system in ("srt", "transformers generate", "transformers continuous batching"):
            figures = level[system]
            assert (figures["completed"], figures["failed"]) == (3, 0), figures
            assert figures["output_lens"] == [5] * 3 and figures["input_lens"] == [12] * 3
        ratios = level["ratios"]["transformers generate"]
        assert ratios["output tok/s"] > 0 and ratios["TTFT p50"] > 0


def test_with_url_transformers_loads_the_model_the_server_reports(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = json.dumps({"model_dir": str(tiny_model_dirs["llama"])}).encode()
    elsewhere = json.dumps(
        {"model_dir": str(tiny_model_dirs["qwen2"])}
    ).encode()  # read only if the 404 is ignored
    answers = {
        "http://srt/server_info": bench_clients.HttpAnswer(200, model_dir),
        "http://vllm/server_info": bench_clients.HttpAnswer(404, elsewhere),
    }
    monkeypatch.setattr(compare_peers, "http_call", lambda url, **kwargs: answers[url])
    args = compare_peers.parse_args(["--url", "http://srt/"])
    assert compare_peers.transformers_model_dir(args) == tiny_model_dirs["llama"]
    with pytest.raises(ValueError, match="pass --model-path"):
        compare_peers.transformers_model_dir(compare_peers.parse_args(["--url", "http://vllm"]))
    explicit = compare_peers.parse_args(
        ["--url", "http://vllm", "--model-path", str(tiny_model_dirs["qwen2"])]
    )
    assert compare_peers.transformers_model_dir(explicit) == tiny_model_dirs["qwen2"]


@pytest.mark.slow  # ~20 s: a server per round
@pytest.mark.timeout(240)
def test_rounds_alternate_srt_and_the_peer_and_print_medians(
    tiny_model_dirs: dict[str, Path], smollm2_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            str(tiny_model_dirs["llama"]),
            "--tokenizer-path",
            str(smollm2_dir),
            *WORKLOAD,
            "--concurrency",
            "3",
            "--dtype",
            "float32",
            "--peers",
            "generate",
            "--rounds",
            "2",
            "--server-args",
            "--max-total-tokens 4096",
            "--json",
            "out.json",
        ],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.index("round 1 of 2") < out.index("round 2 of 2"), out
    assert (
        len(
            re.findall(
                r"^round [12]: ratio vs transformers generate \(output tok/s, 3 concurrent\): "
                rf"{RATIO}$",
                out,
                re.MULTILINE,
            )
        )
        == 2
    ), out
    assert re.search(
        rf"^ratio vs transformers generate \(output tok/s, 3 concurrent\): {RATIO} "
        rf"\(median of 2 rounds: {RATIO}, {RATIO}\)$",
        out,
        re.MULTILINE,
    ), out
    level = json.loads((tmp_path / "out.json").read_text())["levels"][0]
    assert (
        len(level["rounds"]) == 2 and len(level["round_ratios"]["transformers generate"]["output tok/s"]) == 2
    )
    assert level["ratios"]["transformers generate"]["output tok/s"] == pytest.approx(
        sum(level["round_ratios"]["transformers generate"]["output tok/s"]) / 2
    )  # the median of two
    assert all(
        r["srt"]["completed"] == 3 and r["transformers generate"]["completed"] == 3 for r in level["rounds"]
    )
