"""Rows of the request -> KV slot table.

Each running request owns one row of `req_to_token`; entry [row, pos] is the KV slot
(`page * page_size + offset`) holding the key/value of token position `pos` of that request.
"""

from __future__ import annotations

import heapq

import torch


class ReqToTokenPool:
    """A fixed table of `size` rows, each `max_context_len` slots long.

    Rows are handed out lowest index first (a min-heap of free rows), so every rank that makes the
    same sequence of `alloc`/`free` calls gets the same rows. With `padding_row` the table has one
    more row, `size`, never handed out: the padding rows of a CUDA graph's batch read it
    (model_executor/cuda/graph_plan.py).
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str | torch.device = "cpu",
        *,
        padding_row: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.padding_row: int | None = size if padding_row else None
        rows = size + 1 if padding_row else size
        self.req_to_token = torch.zeros((rows, max_context_len), dtype=torch.int64, device=self.device)
        self._free_rows: list[int] = list(range(size))  # a heap; sorted ascending is a valid heap
        self._row_is_free: list[bool] = [True] * size

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def used_rows(self) -> list[int]:
        """The rows in use, ascending. Mutates nothing."""
        return [row for row, free in enumerate(self._row_is_free) if not free]

    def alloc(self) -> int | None:
        """Take the lowest free row; None (and no change) when every row is in use.

        Mutates the free-row heap. The row's old contents are left as they were: callers write
        `req_to_token[row, :seq_len]` before reading it.
        """
        if not self._free_rows:
            return None
        row = heapq.heappop(self._free_rows)
        self._row_is_free[row] = False
        return row

    def free(self, idx: int) -> None:
        """Return row `idx` to the pool. Mutates the free-row heap.

        Raises ValueError if `idx` is out of range or already free (a double free).
        """
        if not 0 <= idx < self.size:
            raise ValueError(f"idx must be in [0, {self.size}), got {idx}")
        if self._row_is_free[idx]:
            raise ValueError(f"idx {idx} is already free (double free)")
        self._row_is_free[idx] = True
        heapq.heappush(self._free_rows, idx)

    def reset(self) -> None:
        """Mark every row free. Mutates the free-row heap; `req_to_token` is left as is."""
        self._free_rows = list(range(self.size))
        self._row_is_free = [True] * self.size
