"""Pipeline parallelism: which layers a stage owns, and what one stage hands the next.

Stage p runs layers [start, end) of the model; the first stage also embeds the input ids, the last
one also applies the final norm and the LM head (and samples). Between stages travel the hidden
states and the residual of the stage's last layer, by point-to-point send/recv on the PP group.

Sends are asynchronous and never waited on in the step loop: a stage blocks only on what it
receives, and every receive waits for something an earlier step produced, so no pair of ranks can
wait on each other (no send/recv deadlock, whatever the number of micro-batches in flight).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from model_executor.distributed.communicator import Communicator, decode_object, encode_object

logger = logging.getLogger("srt.pipeline")

LAYER_PARTITION_ENV = "SRT_PP_LAYER_PARTITION"  # e.g. "16,14": layers per stage, first to last

# Tags keep the three kinds of traffic between two stages apart.
TAG_OBJECT, TAG_HIDDEN, TAG_IDS = 1, 2, 3


def lm_head_cost_in_layers(config: Any) -> float:
    """The LM head's weights in units of one decoder layer's (Llama-style attention + gated MLP).
    A decode step reads every weight once, so this is what the last stage's head costs it."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * int(config.intermediate_size)
    return int(config.vocab_size) * hidden / layer


def partition_layers(
    num_layers: int, pp_size: int, override: str | None = None, head_cost: float = 0.0
) -> list[int]:
    """Layers per stage, so that every stage reads about as many weights per decode step: the
    last stage also runs the LM head (`head_cost`, in layers: lm_head_cost_in_layers), so it gets
    fewer layers; the others split the rest evenly (the remainder to the first ones). With
    head_cost 0 this is the even split. `override` ("16,14") wins."""
    if override:
        try:
            counts = [int(part) for part in override.split(",")]
        except ValueError:
            raise ValueError(
                f"{LAYER_PARTITION_ENV} must be comma-separated layer counts, got {override!r}"
            ) from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{LAYER_PARTITION_ENV}={override!r} must give {pp_size} positive layer counts "
                f"summing to the model's {num_layers} layers"
            )
        return counts
    if num_layers < pp_size:
        raise ValueError(
            f"--pp-size {pp_size} exceeds the model's {num_layers} layers: every stage needs a layer"
        )
    if pp_size == 1:
        return [num_layers]
    last = round((num_layers + head_cost) / pp_size - head_cost)
    last = max(1, min(num_layers - (pp_size - 1), last, -(-num_layers // pp_size)))
    rest = num_layers - last
    counts = [rest // (pp_size - 1) + (1 if i < rest % (pp_size - 1) else 0) for i in range(pp_size - 1)]
    return [*counts, last]


@dataclass(frozen=True)
class PipelineStage:
    """The slice of the model one PP rank runs."""

    rank: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int = -1  # exclusive; -1: every layer (a single stage)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns_layer(self, index: int) -> bool:
        return self.start_layer <= index and (self.end_layer < 0 or index < self.end_layer)

    @staticmethod
    def of(num_layers: int, pp_rank: int, pp_size: int, head_cost: float = 0.0) -> PipelineStage:
        counts = partition_layers(num_layers, pp_size, os.environ.get(LAYER_PARTITION_ENV), head_cost)
        start = sum(counts[:pp_rank])
        if pp_size > 1 and pp_rank == 0:
            logger.info(
                "pipeline stages own layers %s (%s)",
                counts,
                ", ".join(f"stage {p}: {sum(counts[:p])}-{sum(counts[: p + 1]) - 1}" for p in range(pp_size)),
            )
        return PipelineStage(pp_rank, pp_size, start, start + counts[pp_rank])


@dataclass
class StageOutput:
    """What a non-last stage hands the next: its last layer's output and the residual stream."""

    hidden: torch.Tensor  # [num_tokens, hidden_size] float32: the last layer's output (RowParallelLinear)
    residual: torch.Tensor  # [num_tokens, hidden_size] float32 (layers/layernorm.py)


class StageLink:
    """Point-to-point traffic of one rank with its neighbours in the PP group (same TP rank)."""

    def __init__(self, pp: Communicator) -> None:
        self.pp = pp
        self._sending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    @property
    def prev(self) -> int:
        return self.pp.rank_in_group - 1

    @property
    def next(self) -> int:
        return self.pp.rank_in_group + 1

    @property
    def last(self) -> int:
        return self.pp.world_size - 1

    def _group(self, tensor: torch.Tensor) -> dist.ProcessGroup | None:
        # Objects and ids travel on the CPU (gloo) group, hidden states on the device group.
        return self.pp.cpu_group if tensor.device.type == "cpu" else self.pp.device_group

    def _isend(self, tensor: torch.Tensor, dst_in_group: int, tag: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.pp.ranks[dst_in_group], group=self._group(tensor), tag=tag)
        assert work is not None  # None only for ranks outside the group
        self._sending.append((work, tensor))  # keeps the buffer alive until the transfer is done
        while self._sending and self._sending[0][0].is_completed():
            self._sending.popleft()

    def _recv(self, tensor: torch.Tensor, src_in_group: int, tag: int) -> torch.Tensor:
        dist.recv(tensor, src=self.pp.ranks[src_in_group], group=self._group(tensor), tag=tag)
        return tensor

    # ------------------------------------------------------------------ Python objects
    def send_object(self, obj: object, dst_in_group: int) -> None:
        payload = encode_object(obj)  # an empty list: the size alone
        self._isend(torch.tensor([len(payload)], dtype=torch.int64), dst_in_group, TAG_OBJECT)
        if payload:
            self._isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst_in_group, TAG_OBJECT)

    def recv_object(self, src_in_group: int) -> object:
        size = self._recv(torch.empty(1, dtype=torch.int64), src_in_group, TAG_OBJECT)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            self._recv(data, src_in_group, TAG_OBJECT)
        return decode_object(data)

    # ------------------------------------------------------------------ hidden states
    def send_stage_output(self, out: StageOutput) -> None:
        self._isend(out.hidden, self.next, TAG_HIDDEN)
        self._isend(out.residual, self.next, TAG_HIDDEN)

    def recv_stage_output(self, num_tokens: int, hidden_size: int, device: torch.device) -> StageOutput:
        hidden = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=device)
        residual = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=device)
        self._recv(hidden, self.prev, TAG_HIDDEN)
        self._recv(residual, self.prev, TAG_HIDDEN)
        return StageOutput(hidden, residual)

    # ------------------------------------------------------------------ sampled ids
    def send_ids(self, ids: torch.Tensor) -> None:
        """The last stage hands a micro-batch's sampled ids to every other stage."""
        for stage in range(self.last):
            self._isend(ids.to("cpu", torch.int64), stage, TAG_IDS)

    def recv_ids(self, batch_size: int) -> torch.Tensor:
        return self._recv(torch.empty(batch_size, dtype=torch.int64), self.last, TAG_IDS)
