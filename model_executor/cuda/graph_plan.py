"""GraphPlan: which decode batch sizes get a CUDA graph, how a batch is padded to one, and what the
graphs were captured against. Pure bookkeeping: no CUDA here (the runner is graph_runner.py).

A batch of `bs` requests replays the graph of the smallest captured size >= bs; rows bs..size-1
are padding:

    row         | 0 .. bs-1 (the batch's)  | bs .. size-1 (padding)
    req_pool    | the requests' rows       | the padding row (ReqToTokenPool's spare, never handed out)
    seq_len     | the requests' lengths    | 1
    position    | seq_len - 1              | 0
    input_id    | the new tokens           | 0
    out_cache   | the new tokens' slots    | the padding slot (PagedKVPool's spare page, never allocated)

`req_to_token[padding row, 0]` is the padding slot, so a padding row attends over the one slot it
has just written in the same layer: no uninitialised KV is read, and no request's KV is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

AUTO_MAX_BS = 256  # srt's --cuda-graph-max-bs when not given (SGLang picks by GPU memory)


def default_capture_sizes(max_bs: int) -> list[int]:
    """SGLang's decode sizes (no speculative decoding) up to `max_bs`, `max_bs` itself always among
    them."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def capture_sizes(max_bs: int | None, explicit: Sequence[int] | None, max_running_requests: int) -> list[int]:
    """The batch sizes to capture, ascending: `explicit` (--cuda-graph-bs) if given, else the
    default sizes up to `max_bs` (--cuda-graph-max-bs; None: min(max running requests,
    AUTO_MAX_BS)); never above `max_running_requests`, which no decode batch exceeds. Raises
    ValueError on a size < 1."""
    if max_bs is not None and max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be positive, got {max_bs}")
    if explicit is not None and (not explicit or min(explicit) < 1):
        raise ValueError(f"--cuda-graph-bs must be positive sizes, got {list(explicit)}")
    if explicit:
        sizes = sorted(set(explicit))
    else:
        sizes = default_capture_sizes(min(max_running_requests, AUTO_MAX_BS) if max_bs is None else max_bs)
    kept = [s for s in sizes if s <= max_running_requests]
    if sizes[-1] > max_running_requests and max_running_requests not in kept:
        kept.append(max_running_requests)  # the largest batch there can be still gets its graph
    return kept


@dataclass(frozen=True)
class Padding:
    """What a padding row holds (the table in the module doc)."""

    req_pool_index: int
    out_cache_loc: int
    seq_len: int = 1
    position: int = 0
    input_id: int = 0


@dataclass
class GraphPlan:
    sizes: tuple[int, ...]  # ascending
    padding: Padding
    # (what, data_ptr) of every tensor a graph reads or writes outside its own buffers: recorded at
    # capture, since a replay addresses memory by pointer and never sees a tensor reallocated
    captured_against: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        assert self.sizes and list(self.sizes) == sorted(set(self.sizes)) and self.sizes[0] >= 1, self.sizes

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, bs: int) -> int | None:
        """The smallest captured size >= bs; None above the largest."""
        return next((s for s in self.sizes if s >= bs), None)

    def record(self, tensors: tuple[tuple[str, int], ...]) -> None:
        """Notes the pointers the graphs were captured against. Mutates the plan."""
        self.captured_against = tensors

    def still_valid(self, tensors: tuple[tuple[str, int], ...]) -> bool:
        """Whether the graphs still address these tensors: the same names at the same pointers."""
        return bool(self.captured_against) and tensors == self.captured_against

    def padded(self, values: list[int], size: int, field: str) -> list[int]:
        """`values` (one per request) followed by `field`'s padding value up to `size` rows."""
        assert len(values) <= size, (len(values), size)
        return [*values, *[getattr(self.padding, field)] * (size - len(values))]
