"""One rank's KV memory as the scheduler is handed it: request rows, the paged pool, its allocator
(and the local layers' window pages where the model has sliding windows, each token's routed
experts where the server keeps them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mem_cache.allocator import PageAllocator
from mem_cache.budget import KVBudget
from mem_cache.kv_pool import PagedKVPool
from mem_cache.req_to_token_pool import ReqToTokenPool
from mem_cache.routes_pool import RoutesPool
from mem_cache.window_pages import WindowPages


@dataclass(frozen=True)
class KVMemory:
    """Built once by the model runner after the budget is agreed; the scheduler's KV manager takes
    it at construction and is the only one to allocate or free from it afterwards (the model only
    reads and writes the slots a step was given)."""

    req_to_token_pool: ReqToTokenPool
    kv_pool: PagedKVPool
    allocator: PageAllocator
    budget: KVBudget
    routes: RoutesPool | None = None  # each token's experts (--enable-return-routed-experts)
    window: WindowPages | None = None  # the local layers' pages (mem_cache/window_pages.py)

    def reset(self) -> None:
        """Frees every page and request row at once (a test's or benchmark's runs; whatever holds
        them, a KV manager or a radix cache, is not told)."""
        self.allocator.reset()
        self.req_to_token_pool.reset()
        if self.window is not None:
            self.window.reset()

    def alloc_extend(
        self, rows: list[int], prefix_lens: list[int], seq_lens: list[int]
    ) -> torch.Tensor | None:
        """PageAllocator.alloc_extend on the request table, each new full page with a window page
        (enough must be free: the KV manager checks). The slots, or None with nothing changed."""
        table = self.req_to_token_pool.req_to_token
        if (
            self.window is not None
            and self.allocator.pages_needed(prefix_lens, seq_lens) > self.window.allocator.num_free_pages
        ):
            return None
        out = self.allocator.alloc_extend(table, rows, prefix_lens, seq_lens)
        if out is not None and self.window is not None:
            self.window.attach(out)
            self.window.write(table, rows, prefix_lens, seq_lens)
        return out

    def free_slots(self, slots: torch.Tensor) -> None:
        """Frees the full pages `slots` fall in, with their window pages. Mutates the allocators;
        raises as PageAllocator.free_pages does."""
        if self.window is not None and slots.numel():
            self.window.free(torch.unique(slots.reshape(-1).to(torch.int64) // self.page_size))
        self.allocator.free_slots(slots)

    def free_tail(self, row: int, keep: int, end: int) -> None:
        """Frees the pages of request row `row` (holding `end` tokens) past its first `keep`: the
        pages that start at or after keep; a partly kept page stays the row's, and its next tokens
        continue it."""
        start = -(-keep // self.page_size) * self.page_size
        if start < end:
            self.free_slots(self.req_to_token_pool.req_to_token[row, start:end])

    @property
    def page_size(self) -> int:
        return self.budget.page_size

    @property
    def max_total_tokens(self) -> int:
        return self.budget.num_tokens
