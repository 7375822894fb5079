"""Tensor parallelism on spawned gloo ranks gives the greedy tokens of one rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from srt.engine import Engine
from srt.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 3, 25)]


def run(model_dir: Path, tp: int, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
    with Engine(str(model_dir), tp_size=tp, dtype="float32", max_total_tokens=2048) as engine:
        return [o.output_ids for o in engine.generate(prompt_ids, params)]


@pytest.mark.parametrize(
    "arch", [pytest.param("llama", marks=pytest.mark.slow), "llama_mqa", "qwen2", "qwen3"]
)
def test_tp2_equals_tp1_tiny(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    ids = prompts(320)
    assert run(tiny_model_dirs[arch], 2, ids, GREEDY) == run(tiny_model_dirs[arch], 1, ids, GREEDY)


def test_tp2_seeded_sampling_equals_tp1(tiny_model_dirs: dict[str, Path]) -> None:
    ids = prompts(320)
    assert run(tiny_model_dirs["llama"], 2, ids, SEEDED) == run(tiny_model_dirs["llama"], 1, ids, SEEDED)


@pytest.mark.slow  # TP=3 on SmolLM2 runs in the default run through test_reference_bf16
def test_tp3_smollm2_equals_tp1(smollm2_dir: Path) -> None:
    ids = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 28, 2287, 3314, 30, 1], [42] * 12]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert run(smollm2_dir, 3, ids, params) == run(smollm2_dir, 1, ids, params)


def test_indivisible_tp_size_is_a_clear_error(smollm2_dir: Path) -> None:
    with pytest.raises(
        RuntimeError,
        match=r"number of attention heads \(9\) is not divisible by the tensor-parallel size \(2\)",
    ):
        Engine(str(smollm2_dir), tp_size=2, dtype="float32", max_total_tokens=1024)


def test_a_rank_lost_at_start_up_is_named_at_once(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    """A script that starts a TP engine without a main guard: each spawned rank re-imports it and
    dies bootstrapping. The engine names the dead rank and the fix within seconds (it waited out
    its 300 s start timeout before)."""
    script = tmp_path / "no_main_guard.py"
    script.write_text(
        "import sys\nfrom srt.engine import Engine\n"
        "Engine(sys.argv[1], tp_size=2, dtype='float32', max_total_tokens=1024)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dirs["llama"])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode != 0
    assert re.search(
        r"RuntimeError: tensor-parallel rank \d exited with code 1(, rank \d exited with code 1)? during start-up",
        done.stderr,
    ), done.stderr[-3000:]
    assert 'under `if __name__ == "__main__":`' in done.stderr


def test_a_rank_lost_between_calls_is_named_and_ends_the_engine(tiny_model_dirs: dict[str, Path]) -> None:
    ids = prompts(320)
    with Engine(str(tiny_model_dirs["llama"]), tp_size=2, dtype="float32", max_total_tokens=2048) as engine:
        assert len(engine.generate(ids, GREEDY)) == 3
        victim = engine._procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited by signal SIGKILL"):
            engine.generate(ids, GREEDY)
        assert not engine._procs  # the other rank was shut down
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            engine.generate(ids, GREEDY)
