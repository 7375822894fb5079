"""One rank's KV memory as the scheduler is handed it: request rows, the paged pool, its allocator
(and each token's routed experts where the server keeps them)."""

from __future__ import annotations

from dataclasses import dataclass

from mem_cache.allocator import PageAllocator
from mem_cache.budget import KVBudget
from mem_cache.kv_pool import PagedKVPool
from mem_cache.req_to_token_pool import ReqToTokenPool
from mem_cache.routes_pool import RoutesPool


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

    @property
    def page_size(self) -> int:
        return self.budget.page_size

    @property
    def max_total_tokens(self) -> int:
        return self.budget.num_tokens
