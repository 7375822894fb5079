"""Drive one Scheduler in-process (TP=1): messages in through a fake receiver, outputs captured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_executor.distributed.parallel_state import single_process_state
from model_executor.model_runner import ModelRunner
from scheduler.entry import runner_config
from scheduler.pipeline import PipelineScheduler
from scheduler.scheduler import Scheduler
from srt.io_struct import BatchTokenIDOut, TokenizedGenerateReq
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs


class FakeReceiver:
    def __init__(self) -> None:
        self.inbox: list[Any] = []

    def recv(self, wait_ms: int) -> list[Any]:
        out, self.inbox = self.inbox, []
        return out


class Harness:
    """micro_batches > 1: the pipeline loop on one stage (tokens come back `micro_batches`
    iterations after their batch was launched, as from a last stage that far down the pipe)."""

    def __init__(
        self,
        model_dir: Path,
        micro_batches: int = 0,
        dtype: str = "float32",
        eos_token_ids: frozenset[int] = frozenset(),
        tokenizer_loader: Any = lambda: None,
        **server_args: Any,
    ) -> None:
        self.args = ServerArgs(model_path=str(model_dir), dtype=dtype, **server_args)
        self.runner = ModelRunner(runner_config(self.args, model_dir))
        self.receiver = FakeReceiver()
        self.outputs: list[Any] = []
        args = (
            self.args,
            single_process_state(),
            self.runner,
            self.receiver,
            self.outputs.append,
            set(eos_token_ids),
            tokenizer_loader,
        )
        self.scheduler = (
            PipelineScheduler(*args, micro_batches=micro_batches) if micro_batches else Scheduler(*args)
        )  # type: ignore[arg-type]
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}
        self.meta: dict[str, dict[str, int]] = {}

    def submit(
        self, rid: str, input_ids: list[int], params: SamplingParams, seed: int = 0, stream: bool = False
    ) -> None:
        self.receiver.inbox.append(TokenizedGenerateReq(rid, input_ids, params, seed, stream))

    def send(self, msg: Any) -> None:
        self.receiver.inbox.append(msg)

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            self.scheduler.step()
            self._collect()
            if not (self.scheduler.has_work() or self.receiver.inbox):
                return
        raise AssertionError("scheduler did not go idle")

    def _collect(self) -> None:
        for out in self.outputs:
            if isinstance(out, BatchTokenIDOut):
                for i, rid in enumerate(out.rids):
                    self.tokens.setdefault(rid, []).extend(out.new_token_ids[i])
                    self.meta[rid] = {
                        "prompt_tokens": out.prompt_tokens[i],
                        "cached_tokens": out.cached_tokens[i],
                        "completion_tokens": out.completion_tokens[i],
                    }
                    if out.finished_reasons[i] is not None:
                        self.finished[rid] = out.finished_reasons[i]
        self.outputs.clear()

    def integrity_error(self) -> str | None:
        return self.scheduler.internal_state()["kv_integrity_error"]  # type: ignore[no-any-return]
