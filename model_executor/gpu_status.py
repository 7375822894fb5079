"""Which GPU paths a GPU run has verified. The machine srt is developed on has no GPU: until a run
on one is committed (its figures under docs/benchmarks/), a rank 0 starting on CUDA says which
unverified paths it is about to use."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("srt.gpu_status")

# path -> "<date> docs/benchmarks/<file>" of the run that verified it; None: not verified yet
GPU_VERIFIED: dict[str, str | None] = {
    "flashinfer": "2026-12-04 docs/benchmarks/2026-12-04-h200-device-check.txt",  # attention/flashinfer_backend.py
    "triton": None,  # a triton attention backend
    "cuda_graph": None,  # a CUDA-graph step runner
    "nccl": None,  # collectives over NCCL (distributed/), at TP or PP > 1
}


def gpu_paths_in_use(device: torch.device, attention_backend: str, world_size: int) -> list[str]:
    """The paths of GPU_VERIFIED a rank on `device` runs: its attention backend's, and NCCL's when
    it has peers. Mutates nothing."""
    if device.type != "cuda":
        return []
    paths = [attention_backend] if attention_backend in GPU_VERIFIED else []
    if world_size > 1:
        paths.append("nccl")
    return paths


def warn_unverified_gpu_paths(device: torch.device, paths: list[str]) -> list[str]:
    """On a CUDA device, logs one WARNING per path of `paths` that GPU_VERIFIED has no run for;
    returns those paths. Nothing off CUDA. Raises ValueError on a path GPU_VERIFIED does not name."""
    unknown = [path for path in paths if path not in GPU_VERIFIED]
    if unknown:
        raise ValueError(f"unknown GPU paths {unknown} (GPU_VERIFIED names {', '.join(GPU_VERIFIED)})")
    if device.type != "cuda":
        return []
    unverified = [path for path in paths if GPU_VERIFIED[path] is None]
    for path in unverified:
        logger.warning(
            "the %s path has not been verified on a GPU yet (see docs/architecture.md, "
            "'Where it differs from the target')",
            path,
        )
    return unverified
