"""Page allocator: which KV pages are free, and which slots a batch's new tokens get.

The free pages are a stack: a page freed last (a finished request's, or one the prefix cache
evicted) is handed out first. The pages in use then stay among the few recently touched ones, so
on CPU the resident memory follows the working set instead of sweeping the whole pool before any
page is reused (a fresh pool hands out 0, 1, 2, ...). Pages that stayed at the bottom of the
stack are the ones to give back to the OS (`PagedKVPool.release_pages`). The order depends only
on the sequence of calls, so every rank that makes the same calls gets the same pages.
"""

from __future__ import annotations

import torch


class KVIntegrityError(RuntimeError):
    """The allocator's bookkeeping disagrees with itself or with the caller's count."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Free-page bookkeeping for a pool of `num_pages` pages of `page_size` slots."""

    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu") -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Mark every page free. Mutates all bookkeeping."""
        # _stack[:_top] are the free pages, the top (next out) last; fresh: N-1, ..., 1, 0
        self._stack = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int64, device=self.device)
        self._top = self.num_pages
        self._page_is_free = torch.ones(self.num_pages, dtype=torch.bool, device=self.device)
        self._num_used_pages = 0

    @property
    def num_free_pages(self) -> int:
        return self._top

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_pages * self.page_size

    @property
    def num_used_pages(self) -> int:
        return self._num_used_pages

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """Take `n` pages (int64 ids); None, with nothing changed, if fewer than `n` are free.

        Mutates the free list. Raises ValueError if `n` < 0.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self._top:
            return None
        pages = self._stack[self._top - n : self._top].flip(0)  # a copy: in the order they were freed
        self._top -= n
        self._page_is_free[pages] = False
        self._num_used_pages += n
        return pages

    def free_page_ids(self) -> torch.Tensor:
        """The free pages (a copy), the longest-free first. Mutates nothing."""
        return self._stack[: self._top].clone()

    def free_pages(self, pages: torch.Tensor) -> None:
        """Return `pages` (integer page ids) to the top of the free stack: allocating as many
        again gives them back in the same order. Mutates the free list.

        Raises ValueError, freeing nothing, if a page is out of range, repeated, or already free.
        """
        if pages.is_floating_point() or pages.is_complex():
            raise ValueError(f"pages must be an integer tensor, got dtype {pages.dtype}")
        pages = pages.reshape(-1).to(device=self.device, dtype=torch.int64)
        if pages.numel() == 0:
            return
        low, high = int(pages.min()), int(pages.max())
        if low < 0 or high >= self.num_pages:
            raise ValueError(f"pages must be in [0, {self.num_pages}), got min {low} max {high}")
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError(f"pages contains repeated page ids: {pages.tolist()[:16]}")
        already_free = pages[self._page_is_free[pages]]
        if already_free.numel() > 0:
            raise ValueError(f"pages {already_free.tolist()[:16]} are already free (double free)")
        n = int(pages.numel())
        self._page_is_free[pages] = True
        self._stack[self._top : self._top + n] = pages.flip(0)
        self._top += n
        self._num_used_pages -= n

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free the distinct pages that `slots` fall in (`slot // page_size`).

        Mutates the free list; raises as `free_pages` does.
        """
        if slots.is_floating_point() or slots.is_complex():
            raise ValueError(f"slots must be an integer tensor, got dtype {slots.dtype}")
        if slots.numel() == 0:
            return
        self.free_pages(torch.unique(slots.reshape(-1).to(torch.int64) // self.page_size))

    def pages_needed(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """New pages to grow each request from `prefix_lens[i]` to `seq_lens[i]` tokens.

        A request's tokens fill whole pages in order, so it holds ceil(len / page_size) pages.
        Raises ValueError if the lists differ in length or some prefix_len > seq_len or < 0.
        """
        if len(prefix_lens) != len(seq_lens):
            raise ValueError(
                f"prefix_lens and seq_lens differ in length: {len(prefix_lens)} vs {len(seq_lens)}"
            )
        total = 0
        for i, (prefix, seq) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
            if not 0 <= prefix <= seq:
                raise ValueError(f"need 0 <= prefix_lens[{i}] <= seq_lens[{i}], got {prefix} and {seq}")
            total += _ceil_div(seq, self.page_size) - _ceil_div(prefix, self.page_size)
        return total

    def alloc_extend(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        seq_lens: list[int],
    ) -> torch.Tensor | None:
        """Give KV slots to positions prefix_lens[i] .. seq_lens[i]-1 of each request i.

        A request's last page may be partly filled; its new tokens continue that page first,
        then take fresh pages:

            page_size 4, prefix 6, seq 11 (c = cached, n = new):
            position  | 0 1 2 3 | 4 5 6 7 | 8 9 10 _ |
                      | c c c c | c c n n | n n n  _ |
                                 partial:   fresh page from boundary 8;
                                 slot of 5  slot = page * 4 + position % 4
                                 + 1, + 2

        Writes the slots into `req_to_token[row, prefix:seq]` and returns them (int64,
        concatenated in request order). All-or-nothing: if the batch needs more pages than are
        free, returns None and changes nothing. Raises ValueError on inconsistent arguments.
        """
        self._check_extend_args(req_to_token, req_pool_indices, prefix_lens, seq_lens)
        extend_lens = [seq - prefix for prefix, seq in zip(prefix_lens, seq_lens, strict=True)]
        num_tokens = sum(extend_lens)
        num_new_pages = self.pages_needed(prefix_lens, seq_lens)
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        new_pages = self.alloc_pages(num_new_pages)
        if new_pages is None:
            return None

        ps, dev = self.page_size, self.device
        if ps == 1:
            # One-token pages: the tokens' slots are the new pages in order (the general path below
            # gives the same in ~20 tensor ops; this is on every step's path).
            slots = new_pages.clone()
            table_slots = slots.to(req_to_token.device)
            if all(n == 1 for n in extend_lens):  # a decode step: one index op
                rows_t = torch.tensor(req_pool_indices, dtype=torch.int64, device=req_to_token.device)
                pos_t = torch.tensor(prefix_lens, dtype=torch.int64, device=req_to_token.device)
                req_to_token[rows_t, pos_t] = table_slots
                return slots
            start = 0
            for row, prefix, seq in zip(req_pool_indices, prefix_lens, seq_lens, strict=True):
                req_to_token[row, prefix:seq] = table_slots[start : start + seq - prefix]
                start += seq - prefix
            return slots
        # Per request, on Python ints: where the partial last page ends and where its fresh pages
        # start in `new_pages`.
        boundaries = [_ceil_div(prefix, ps) * ps for prefix in prefix_lens]
        page_starts, next_page = [], 0
        for prefix, seq in zip(prefix_lens, seq_lens, strict=True):
            page_starts.append(next_page)
            next_page += _ceil_div(seq, ps) - _ceil_div(prefix, ps)
        assert next_page == num_new_pages

        # Per token, in a fixed number of tensor ops whatever the batch size.
        extend_t = torch.tensor(extend_lens, dtype=torch.int64, device=dev)
        req_of_token = torch.repeat_interleave(extend_t, output_size=num_tokens)  # no device sync
        token_start = torch.cumsum(extend_t, 0) - extend_t
        prefix_t = torch.tensor(prefix_lens, dtype=torch.int64, device=dev)
        pos = prefix_t[req_of_token] + torch.arange(num_tokens, device=dev) - token_start[req_of_token]
        boundary_of_token = torch.tensor(boundaries, dtype=torch.int64, device=dev)[req_of_token]
        rows_t = torch.tensor(req_pool_indices, dtype=torch.int64, device=dev)

        slots = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        if num_new_pages > 0:
            page_rank = torch.tensor(page_starts, dtype=torch.int64, device=dev)[req_of_token] + (
                (pos - boundary_of_token).clamp(min=0) // ps
            )
            page_rank = page_rank.clamp(max=num_new_pages - 1)  # tokens of partial pages: unused
            slots = new_pages[page_rank] * ps + pos % ps
        partial = [
            i for i, (p, n) in enumerate(zip(prefix_lens, extend_lens, strict=True)) if p % ps != 0 and n > 0
        ]
        if partial:
            # Slot of position p in a partial page = slot of (prefix - 1) + (p - prefix + 1).
            partial_t = torch.tensor(partial, dtype=torch.int64, device=dev)
            last_slots = req_to_token[rows_t[partial_t], prefix_t[partial_t] - 1].to(dev)
            offset = torch.zeros(len(prefix_lens), dtype=torch.int64, device=dev)
            offset[partial_t] = last_slots - prefix_t[partial_t] + 1
            slots = torch.where(pos < boundary_of_token, offset[req_of_token] + pos, slots)

        req_to_token[rows_t[req_of_token].to(req_to_token.device), pos.to(req_to_token.device)] = slots.to(
            req_to_token.device
        )
        return slots

    def _check_extend_args(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        seq_lens: list[int],
    ) -> None:
        if req_to_token.dim() != 2 or req_to_token.dtype != torch.int64:
            raise ValueError(
                f"req_to_token must be a 2-D int64 tensor, got {req_to_token.dim()}-D {req_to_token.dtype}"
            )
        num_rows, max_len = req_to_token.shape
        if not len(req_pool_indices) == len(prefix_lens) == len(seq_lens):
            raise ValueError(
                "req_pool_indices, prefix_lens and seq_lens must have one entry per request, got lengths "
                f"{len(req_pool_indices)}, {len(prefix_lens)}, {len(seq_lens)}"
            )
        for i, (row, prefix, seq) in enumerate(zip(req_pool_indices, prefix_lens, seq_lens, strict=True)):
            if not 0 <= row < num_rows:
                raise ValueError(f"req_pool_indices[{i}] must be in [0, {num_rows}), got {row}")
            if not 0 <= prefix <= seq <= max_len:
                raise ValueError(
                    f"need 0 <= prefix_lens[{i}] <= seq_lens[{i}] <= {max_len} (max context), got {prefix}, {seq}"
                )

    def check_integrity(self, expected_used_pages: int | None = None) -> None:
        """Check that free + used == total, free pages are distinct and in range, and agree
        with the per-page free mask (and used == `expected_used_pages` when given).

        Mutates nothing. Raises KVIntegrityError naming every problem found and the counts.
        """
        free = self._stack[: self._top]
        num_free, num_used = int(free.numel()), self._num_used_pages
        problems = []
        if num_free + num_used != self.num_pages:
            problems.append(f"free {num_free} + used {num_used} != total {self.num_pages}")
        num_distinct = int(torch.unique(free).numel())
        if num_distinct != num_free:
            problems.append(f"free list holds {num_free - num_distinct} duplicate page(s)")
        in_range = free[(free >= 0) & (free < self.num_pages)]
        if in_range.numel() != num_free:
            problems.append(
                f"free list holds {num_free - in_range.numel()} page id(s) outside [0, {self.num_pages})"
            )
        num_marked = int(self._page_is_free.sum())
        if num_marked != num_distinct or not bool(self._page_is_free[in_range].all()):
            problems.append(
                f"free mask marks {num_marked} pages free, free list holds {num_distinct} distinct"
            )
        if expected_used_pages is not None and expected_used_pages != num_used:
            problems.append(f"used {num_used} != expected {expected_used_pages}")
        if problems:
            raise KVIntegrityError(
                "KV page allocator integrity check failed: "
                + "; ".join(problems)
                + f" (total {self.num_pages}, free {num_free}, used {num_used}, page_size {self.page_size})"
            )
