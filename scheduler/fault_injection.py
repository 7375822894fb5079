"""Faults on demand, for tests: SRT_TEST_FAULT="KIND@RANK:STEP[/START][,KIND@RANK:STEP[/START]...]".

RANK is the world rank; STEP counts that rank's forward steps from 1, and STEP 0 means during
start-up. START is the engine start the fault fires in (0: the first; n: after the n-th restart,
see srt/recovery.py); without it the fault fires in every start (a crash loop). A no-op (one
boolean test per step) unless the variable is set.

    crash          the rank exits at once (os._exit)
    raise          an exception in its forward
    stall          its forward sleeps forever
    diverge_token  from STEP on, its sampled id of the first request is replaced by a larger id
    diverge_batch  from STEP on, it admits one request fewer than the other ranks would
    diverge_grammar at STEP, its matcher of each constrained request does not accept the new token
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from srt.utils import engine_start as current_engine_start

logger = logging.getLogger("srt.fault")

ENV_VAR = "SRT_TEST_FAULT"
KINDS = ("crash", "raise", "stall", "diverge_token", "diverge_batch", "diverge_grammar")
CRASH_EXIT_CODE = 13


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    start: int | None = None  # the engine start it fires in; None: every start


def parse_faults(spec: str | None) -> list[Fault]:
    faults = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        try:
            kind, where = item.split("@")
            rank, when = where.split(":")
            step, _, start = when.partition("/")
            fault = Fault(kind, int(rank), int(step), int(start) if start else None)
        except ValueError:
            raise ValueError(f"{ENV_VAR}: cannot parse {item!r}; expected KIND@RANK:STEP[/START]") from None
        if fault.kind not in KINDS:
            raise ValueError(f"{ENV_VAR}: unknown fault {fault.kind!r}; one of {', '.join(KINDS)}")
        if fault.step < 0 or fault.rank < 0 or (fault.start is not None and fault.start < 0):
            raise ValueError(f"{ENV_VAR}: rank, step and start must be >= 0 in {item!r}")
        faults.append(fault)
    return faults


class FaultInjector:
    def __init__(self, world_rank: int, spec: str | None = None, engine_start: int | None = None) -> None:
        spec = os.environ.get(ENV_VAR) if spec is None else spec
        start = current_engine_start() if engine_start is None else engine_start
        self.faults = [f for f in parse_faults(spec) if f.rank == world_rank and f.start in (None, start)]
        self.active = bool(self.faults)
        self.world_rank = world_rank

    def _due(self, kind: str, step: int, *, from_step: bool = False) -> bool:
        return any(f.kind == kind and (f.step <= step if from_step else f.step == step) for f in self.faults)

    def _fire(self, step: int) -> None:
        if self._due("crash", step):
            logger.error("fault injection: crash on rank %d at step %d", self.world_rank, step)
            logging.shutdown()
            os._exit(CRASH_EXIT_CODE)
        if self._due("raise", step):
            raise RuntimeError(f"fault injection: raise on rank {self.world_rank} at step {step}")
        if self._due("stall", step):
            logger.error("fault injection: stall on rank %d at step %d", self.world_rank, step)
            while True:
                time.sleep(3600)

    def at_startup(self) -> None:
        if self.active:
            self._fire(0)

    def before_forward(self, step: int) -> None:
        if self.active and step > 0:
            self._fire(step)

    def corrupt_tokens(self, step: int, next_ids: torch.Tensor, vocab_size: int) -> None:
        if self.active and self._due("diverge_token", step, from_step=True) and next_ids.numel():
            next_ids[0] = min(int(next_ids[0]) + 1, vocab_size - 1)

    def drop_one_admission(self, step: int) -> bool:
        return self.active and self._due("diverge_batch", step, from_step=True)

    def skip_grammar_accept(self, step: int, req: object) -> bool:
        return (
            self.active and getattr(req, "grammar", None) is not None and self._due("diverge_grammar", step)
        )
