"""SRT_CPU_KERNEL_ISA: each forced kernel path (the ones a CPU with fewer features takes) answers
the probes as that CPU would and keeps parity with transformers. The slow test runs a tiny bf16
Llama once per path, each in its own process (the probes and the loaded kernels are per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import hf_float32, hf_forced_logits, hf_greedy, make_tiny_model

from model_executor.cpu.kernels import build

TESTS = Path(__file__).parent
FORCED = ("avx512_bf16", "avx512", "avx2", "none")
STEPS = 16


def test_an_unknown_isa_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.ISA_ENV, "sse2")
    with pytest.raises(
        ValueError, match="SRT_CPU_KERNEL_ISA must be one of auto, avx512_bf16, avx512, avx2, none"
    ):
        build.kernel_isa()


@pytest.mark.parametrize(
    ("isa", "dropped"),
    [
        ("auto", ()),
        ("AVX512_BF16", ("-mno-amx-tile",)),
        ("avx512", ("-mno-amx-int8", "-mno-avx512bf16", "-mno-avx512vnni")),
        ("avx2", ("-mno-amx-tile", "-mno-avx512f")),
    ],
)
def test_a_forced_isa_builds_without_what_that_cpu_lacks(
    isa: str, dropped: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(build.ISA_ENV, isa)
    flags = build._cflags()
    assert flags[: len(build.CFLAGS)] == build.CFLAGS and set(dropped) <= set(flags[len(build.CFLAGS) :])
    assert (len(flags) == len(build.CFLAGS)) == (isa == "auto")


def child(model_dir: str, out: str, tp2: bool) -> None:
    """In a process started with SRT_CPU_KERNEL_ISA set: the start-up line, the probes, and the tiny
    model's bf16 logits (prefill, then decode under teacher forcing) and greedy tokens, at TP 1 (and 2
    where `tp2`)."""
    from test_cpu_kernels import decode_logits

    from srt.engine import Engine
    from srt.sampling_params import SamplingParams

    prompts, forced = _prompts()
    engine = Engine(model_dir, dtype="bfloat16", max_total_tokens=1024)
    assert engine.runner is not None
    logits = decode_logits(engine.runner, prompts, forced)
    engine.runner.memory.reset()
    params = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    greedy = [o.output_ids for o in engine.generate(prompts, params)]
    greedy_tp2: list[list[int]] = []
    if tp2:
        with Engine(model_dir, tp_size=2, dtype="bfloat16", max_total_tokens=1024) as engine_tp2:
            greedy_tp2 = [o.output_ids for o in engine_tp2.generate(prompts, params)]  # ranks inherit the ISA
    probes = {
        name: getattr(build, name)()
        for name in ("amx_available", "bf16_linear_available", "int8_available", "prefill_kernel_available")
    }
    torch.save(
        {
            "paths": build.describe_paths(),
            "probes": probes,
            "loaded": build.kernels() is not None,
            "logits": logits,
            "greedy": greedy,
            "greedy_tp2": greedy_tp2,
        },
        out,
    )


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 30, 7, 19, 1)]
    return prompts, [torch.randint(3, 320, (6,), generator=g).tolist() for _ in prompts]


def run_forced(isa: str, model_dir: Path, tmp_path: Path, tp2: bool) -> dict:
    out = tmp_path / f"{isa}.pt"
    env = {
        **os.environ,
        build.ISA_ENV: isa,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import test_cpu_isa; test_cpu_isa.child({str(model_dir)!r}, {str(out)!r}, {tp2})",
        ],
        env=env,
        check=True,
        timeout=600,
    )
    result: dict = torch.load(out)
    return result


@pytest.mark.slow
@pytest.mark.skipif(build._compiler() is None, reason="no C compiler: only the torch path runs here")
def test_every_forced_kernel_path_keeps_parity_with_transformers(tmp_path: Path) -> None:
    """Each path (no AMX; no AVX-512 BF16 nor VNNI; no AVX-512 at all; no C kernels) says so at start-up and gives
    logits as close to fp32 transformers as the torch ops do (the bound of
    test_bf16_model_with_kernels_is_as_accurate_as_torch_ops), and transformers' greedy tokens at TP 1
    (and 2 on the AVX2 path; or the other side of a near-tie of transformers' fp32 logits)."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    prompts, forced = _prompts()
    hf = hf_float32(model_dir)
    ref = hf_forced_logits(hf, prompts, forced)
    want_greedy = [hf_greedy(hf, p, STEPS) for p in prompts]
    # TP=2 (spawned ranks inherit the forced path) on the path furthest from this CPU's own only
    results = {isa: run_forced(isa, model_dir, tmp_path, tp2=isa == "avx2") for isa in FORCED}
    assert results["avx2"]["greedy_tp2"]

    none, avx512_bf16 = results["none"], results["avx512_bf16"]
    assert not none["loaded"] and "SRT_CPU_KERNEL_ISA=none" in none["paths"]
    assert not any(none["probes"].values())
    for isa in ("avx512", "avx2"):  # no AVX-512 BF16 nor VNNI: the bf16 linears on AVX2 and FMA
        result = results[isa]
        assert result["loaded"] and result["probes"] == {
            "amx_available": False,
            "bf16_linear_available": True,
            "int8_available": False,
            "prefill_kernel_available": False,
        }, result
        assert "bf16 linears on AVX2 FMA" in result["paths"] and "refused (no VNNI)" in result["paths"]
    assert "plain loops: this CPU has no AVX-512" in results["avx2"]["paths"]
    if build.bf16_linear_isa() in ("AMX tiles", "AVX-512 BF16"):  # so does the forced level below AMX
        assert avx512_bf16["probes"] == {
            "amx_available": False,
            "bf16_linear_available": True,
            "int8_available": build.int8_available(),
            "prefill_kernel_available": True,
        }, avx512_bf16
        assert "bf16 linears on AVX-512 BF16" in avx512_bf16["paths"]
    assert all("SRT_CPU_KERNEL_ISA=" in r["paths"] for r in results.values())

    err_torch = (none["logits"] - ref).abs().max().item()
    bound = 1.5 * err_torch + 1e-3
    for isa, result in results.items():
        err = (result["logits"] - ref).abs().max().item()
        assert err <= bound, (isa, err, err_torch)
        for prompt, got, want in zip(prompts * 2, result["greedy"] + result["greedy_tp2"], want_greedy * 2):
            if got != want:  # bf16 may take the other side of a near-tie of transformers' fp32 logits, only
                at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                with torch.no_grad():
                    step = hf(torch.tensor([prompt + want[:at]])).logits[0, -1]
                margin = (step[want[at]] - step[got[at]]).item()
                assert margin <= 2 * bound, (isa, prompt, at, got, want, margin, bound)
