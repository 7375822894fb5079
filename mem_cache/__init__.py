"""KV memory: request rows, KV pages and their slots, and how many pages fit."""

from mem_cache.allocator import KVIntegrityError, PageAllocator
from mem_cache.budget import free_memory_bytes, kv_bytes_per_token, profile_num_pages, total_memory_bytes
from mem_cache.kv_memory import KVMemory
from mem_cache.kv_pool import KVPool, PagedKVPool
from mem_cache.req_to_token_pool import ReqToTokenPool

__all__ = [
    "KVIntegrityError",
    "KVMemory",
    "KVPool",
    "PageAllocator",
    "PagedKVPool",
    "ReqToTokenPool",
    "free_memory_bytes",
    "kv_bytes_per_token",
    "profile_num_pages",
    "total_memory_bytes",
]
