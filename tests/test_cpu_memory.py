"""A rank process keeps freed activation memory in its heap instead of unmapping it."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, psutil, torch
from model_executor.cpu.memory import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
proc = psutil.Process()
x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
before = proc.memory_info().rss
del x
print((before - proc.memory_info().rss) // 2**20)
"""


def released_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_tensors_stay_in_the_heap_only_when_tuned() -> None:
    assert released_mib("default") >= 60  # glibc unmaps a block this large on free
    assert released_mib("tuned") < 4
