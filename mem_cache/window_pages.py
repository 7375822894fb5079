"""The local layers' KV pages of a model with sliding-window attention, kept only while a window can
reach them.

A layer that attends within a window of W tokens (Gemma 2 and 3 interleave such layers with global
ones; Mistral's are all local) reads the K/V of the W - 1 positions before the token it computes and
no older ones. So the pool keeps two kinds of pages:

- full pages: every position, the global layers' K/V. Their ids are what `req_to_token`, the
  allocator and the radix cache hold, as for any model.
- window pages: the local layers' K/V. A full page has at most one (`page_of`); the pair is
  allocated together, and the window page goes with its full page or earlier: once the request
  that owns it is W tokens past it (`slide`).

Which window pages go is a function of positions alone (kv_len, cached_len, W and the page size),
so every rank frees the same ones in the same order. The local layers read their K/V through a
second table, `req_to_token` here (window slots, the same rows and positions); positions whose
window page is gone point at the zeroed null page, so a torch path that gathers a whole row and
masks it reads finite values.

The radix cache keeps full pages; a cached page keeps its window page only if it still had one when
its request finished. A cached prefix is usable up to where the W - 1 positions before its end
all have window pages (`usable_prefix`): past that, the local layers would lack keys.
"""

from __future__ import annotations

import torch

from mem_cache.allocator import PageAllocator


class WindowPages:
    """Window pages for `num_full_pages` full pages: `num_pages` of them (allocated by their own
    `allocator`), one null page past those, and the request table of window slots."""

    def __init__(
        self,
        *,
        num_full_pages: int,
        num_pages: int,
        page_size: int,
        window: int,
        table_rows: int,
        max_context_len: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.page_size = page_size
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages, page_size, device=self.device)
        self.null_slot = num_pages * page_size  # the first slot of the null page
        self.page_of = torch.full((num_full_pages,), -1, dtype=torch.int64, device=self.device)
        self.req_to_token = torch.full(
            (table_rows, max_context_len), self.null_slot, dtype=torch.int64, device=self.device
        )
        # per row: positions below this hold no window page the request owns (the cache's, or freed)
        self._slid_to = [0] * table_rows

    def reset(self) -> None:
        """Every window page free, every full page without one, every row null."""
        self.allocator.reset()
        self.page_of.fill_(-1)
        self.req_to_token.fill_(self.null_slot)
        self._slid_to = [0] * len(self._slid_to)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def translate(self, slots: torch.Tensor) -> torch.Tensor:
        """The window slots of full `slots` (the null page's first slot where a page has none).
        Mutates nothing."""
        ps = self.page_size
        pages = self.page_of[slots // ps]
        return torch.where(pages >= 0, pages * ps + slots % ps, self.null_slot)

    def attach(self, slots: torch.Tensor) -> None:
        """Gives each full page of `slots` that has no window page one. The caller has made sure
        enough are free (as many as the full pages it just allocated); raises RuntimeError if not."""
        pages = torch.unique(slots // self.page_size)
        pages = pages[self.page_of[pages] < 0]
        got = self.allocator.alloc_pages(int(pages.numel()))
        if got is None:
            raise RuntimeError(f"{pages.numel()} window pages wanted, {self.allocator.num_free_pages} free")
        self.page_of[pages] = got

    def admit(self, row: int, prefix: torch.Tensor) -> None:
        """Row `row` starts with the cached full slots `prefix`: the window slots of the pages its
        next token reads (owned by the cache), null before them."""
        n = int(prefix.numel())
        keep = max(n - self.window + 1, 0) // self.page_size * self.page_size
        self.req_to_token[row, :keep] = self.null_slot
        self.req_to_token[row, keep:n] = self.translate(prefix[keep:])
        self._slid_to[row] = n

    def write(self, full_table: torch.Tensor, rows: list[int], starts: list[int], ends: list[int]) -> None:
        """Copies positions starts[i] .. ends[i]-1 of each row from the full table, translated."""
        if all(e - s == 1 for s, e in zip(starts, ends)):  # a decode step: one position a row
            rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
            pos_t = torch.tensor(starts, dtype=torch.int64, device=self.device)
            self.req_to_token[rows_t, pos_t] = self.translate(full_table[rows_t, pos_t])
            return
        for row, start, end in zip(rows, starts, ends):
            self.req_to_token[row, start:end] = self.translate(full_table[row, start:end])

    def slide(self, full_table: torch.Tensor, row: int, kv_len: int) -> None:
        """Frees the window pages of row `row`'s own full pages that lie wholly before kv_len - W + 1
        (a token at kv_len or later never reads them); their window slots become null."""
        ps = self.page_size
        end = max(kv_len - self.window + 1, 0) // ps * ps
        start = self._slid_to[row]
        if end <= start:
            return
        self.free(full_table[row, start:end:ps] // ps)
        self.req_to_token[row, start:end] = self.null_slot
        self._slid_to[row] = end

    def free(self, full_pages: torch.Tensor) -> None:
        """Frees the window pages of `full_pages` (those that have one). Mutates the allocator."""
        full_pages = full_pages.reshape(-1)
        pages = self.page_of[full_pages]
        self.allocator.free_pages(pages[pages >= 0])
        self.page_of[full_pages] = -1

    def drop_unreferenced(self, rows: list[int]) -> int:
        """Frees every window page that no row in `rows` (those in use) points at: the cache's pages
        outside any request's window. Returns how many; a cached prefix ending past them is then
        usable only up to where they begin (`usable_prefix`)."""
        held = torch.nonzero(self.page_of >= 0).reshape(-1)
        referenced = torch.unique(self.req_to_token[rows] // self.page_size) if rows else held[:0]
        drop = held[~torch.isin(self.page_of[held], referenced)]
        self.free(drop)
        return int(drop.numel())

    def usable_prefix(self, kv_indices: torch.Tensor, length: int) -> int:
        """The longest page-aligned n <= `length` whose last W - 1 positions (the keys the token at n
        reads) all have window pages, for a cached prefix of full slots `kv_indices`."""
        ps = self.page_size
        num = length // ps
        if num == 0:
            return 0
        missing = (self.page_of[kv_indices[: num * ps : ps] // ps] < 0).to(torch.int64)
        before = torch.cat([missing.new_zeros(1), missing.cumsum(0)])  # missing pages in [0, k)
        ends = torch.arange(num + 1, device=missing.device)  # n = k * ps
        firsts = (ends * ps - self.window + 1).clamp(min=0) // ps  # first page the token at n reads
        ok = (before[ends] - before[firsts] == 0).nonzero()
        return int(ok[-1]) * ps

    def integrity_error(self, free_full_pages: torch.Tensor) -> str | None:
        """None when every used window page belongs to exactly one full page and no free full page
        has one."""
        if bool((self.page_of[free_full_pages] >= 0).any()):
            return "a free full KV page still holds a window page"
        held = self.page_of[self.page_of >= 0]
        if int(torch.unique(held).numel()) != int(held.numel()):
            return "a window page is held by two full pages"
        try:
            self.allocator.check_integrity(expected_used_pages=int(held.numel()))
        except RuntimeError as e:
            return f"window pages: {e}"
        return None
