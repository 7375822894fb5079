"""The scheduler's view of KV memory: admission (prefix match + lock), slot reservation with
eviction, release into the prefix cache, and the integrity check.

Ownership: a request owns req_to_token[row, cached_len:kv_len]; the prefix cache owns the rest
(locked through req.last_node while the request lives). With window pages (a model with sliding
windows, mem_cache/window_pages.py) each full page may hold a window page, freed with it or once
its request has moved a window past it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from consensus import rank_consensus
from mem_cache.disk_tier import DiskTier
from mem_cache.kv_memory import KVMemory
from mem_cache.radix_cache import BASE, BasePrefixCache, MatchResult, Namespace
from scheduler.req import Req
from srt.io_struct import ControlReply, FlushCacheReq

logger = logging.getLogger("srt.scheduler")


class KVManager:
    def __init__(
        self,
        memory: KVMemory,
        tree_cache: BasePrefixCache,
        long_prompt_over: int | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        """`long_prompt_over`: with LongRoPE's long factors, the prompt length past which a request
        runs every position on them (layers/rotary.py LongRope), so its KV differs from a shorter
        prompt's at the same tokens: the prefix cache keeps the two apart (cache_key). `disk`: the
        prefix cache's tier on disk (--enable-hierarchical-cache), read on a miss, written on release."""
        self.memory = memory
        self.disk = disk
        self._disk_checked: set[str] = set()  # requests whose prefix the disk was asked for
        self._prompt_written: set[str] = set()  # requests whose prompt's blocks went to the disk
        self.long_prompt_over = long_prompt_over
        self.req_to_token_pool = memory.req_to_token_pool
        self.req_to_token = memory.req_to_token_pool.req_to_token
        self.allocator = memory.allocator
        self.kv_pool = memory.kv_pool
        self.window = memory.window
        self.tree_cache = tree_cache
        self.page_size = memory.page_size
        self.max_total_tokens = memory.max_total_tokens
        self.last_out_cache_loc = torch.empty(0, dtype=torch.int64)

    def free_rows(self) -> int:
        return self.req_to_token_pool.num_free

    def available_tokens(self) -> int:
        """Tokens that fit in free pages and what the cache could evict (with window pages, the
        fewer of full and window tokens; evicting may free fewer window pages than that counts)."""
        evictable = self.tree_cache.evictable_size()
        free = self.allocator.num_free_tokens
        if self.window is not None:
            free = min(free, self.window.allocator.num_free_tokens)
        return free + evictable

    def held_tokens(self) -> int:
        """Tokens of the KV pool that requests hold: neither free nor cache the tree could evict
        (the load a router balances on; window pages, which only bound admission, left out)."""
        return self.max_total_tokens - self.allocator.num_free_tokens - self.tree_cache.evictable_size()

    def _usable_prefix(self, req: Req, match: MatchResult) -> int:
        # At least one token must be computed to get logits for the next token (and every
        # position whose logits the request's prompt logprobs need).
        limit = self.tree_cache.page_aligned_len(min(req.seq_len - 1, req.max_cached_prefix_len))
        usable = min(len(match.kv_indices), limit)
        if self.window is not None:  # the local layers need the window before it
            usable = self.window.usable_prefix(match.kv_indices, usable)
        return usable

    def cache_key(self, req: Req, n: int | None = None) -> list[int]:
        """The prefix cache's key of req's first n tokens (all by default): their ids, or for a
        prompt on LongRoPE's long factors throughout each id as -1 - id, an id no token has, so
        the long and the short rotations of the same tokens never share a cached prefix."""
        ids = req.fill_ids if n is None else req.fill_ids[:n]
        if self.long_prompt_over is not None and len(req.origin_input_ids) > self.long_prompt_over:
            return [-1 - t for t in ids]
        return ids

    @staticmethod
    def namespace(req: Req) -> Namespace:
        """What besides its ids req's KV depends on: its LoRA adapter and the weights' epoch
        (mem_cache/radix_cache.py)."""
        return Namespace(adapter=req.lora_id, weight_version=req.weight_epoch)

    def match(self, req: Req) -> tuple[int, MatchResult]:
        """The usable length of `req`'s cached prefix, and the lookup to pass to `admit` if the
        tree does not change in between (a lookup may split a node). Locks nothing. With a disk
        tier, the first lookup of a request first restores into the tree what the disk has past it."""
        if (disk := self._disk_for(req)) is not None and req.rid not in self._disk_checked:
            self._disk_checked.add(req.rid)
            self._restore(req, disk)
        return self._lookup(req)

    def _lookup(self, req: Req) -> tuple[int, MatchResult]:
        match = self.tree_cache.match_prefix(self.cache_key(req), self.namespace(req))
        return self._usable_prefix(req, match), match

    def _disk_for(self, req: Req) -> DiskTier | None:
        """The disk tier for req's prefix: the base model's prefixes under the weights the server
        started with (the files name those weights' files). An adapter's id or a weights' version
        names other KV in another server's life, so their prefixes stay in memory alone."""
        return self.disk if self.namespace(req) == BASE else None

    def peek_prefix_len(self, req: Req) -> int:
        """The tree's usable prefix of `req` (the disk is not asked)."""
        return self._lookup(req)[0]

    @rank_consensus(args={"req": lambda r: r.rid}, result=True, name="disk_restore")
    def _restore(self, req: Req, disk: DiskTier) -> int:
        """Puts the blocks of `req`'s prefix past the tree's match that every rank has on disk into
        new pages and the tree (unlocked, like any cached prefix); returns the tokens restored.
        Each rank reads its own files; the blocks used are the MIN over the world, so every rank
        makes the same pages and tree. Evicts cache for the pages if it must, never the match."""
        key, namespace = self.cache_key(req), self.namespace(req)
        match = self.tree_cache.match_prefix(key, namespace)
        have, t = len(match.kv_indices), disk.block_tokens
        limit = min(req.seq_len - 1, req.max_cached_prefix_len) // t * t
        if have >= limit:  # the same on every rank: no collective
            return 0
        first = have // t  # the block `have` falls in; its part before `have` is in the tree
        blocks = disk.read(disk.block_names(namespace, key, limit // t)[first:])
        n = disk.agree(len(blocks))
        if n == 0:  # (first + n) * t may be short of `have`: nothing past the tree
            return 0
        self.tree_cache.inc_lock_ref(match.last_node)
        pages = ((first + n) * t - have) // self.page_size
        self._ensure_free_pages(pages)
        pages = min(pages, self.allocator.num_free_pages)
        page_ids = self.allocator.alloc_pages(pages)
        self.tree_cache.dec_lock_ref(match.last_node)
        if not pages or page_ids is None:
            return 0
        offsets = torch.arange(self.page_size, device=page_ids.device)
        slots = (page_ids[:, None] * self.page_size + offsets).reshape(-1).to(match.kv_indices.device)
        disk.load_into_pool(blocks[:n], slots, have - first * t)
        restored = self.tree_cache.insert(
            key[: have + len(slots)], torch.cat([match.kv_indices, slots]), namespace
        )
        assert restored == have, (restored, have)
        disk.stats.hit_tokens += len(slots)
        return len(slots)

    @rank_consensus(args={"req": lambda r: r.rid}, result=True, name="radix_match")
    def admit(self, req: Req, match: MatchResult | None = None) -> int:
        """Gives `req` a row and its cached prefix (locked). `match`: this request's lookup, made
        since the tree last changed. Raises if no row is free."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            raise RuntimeError("no free request row; admission must respect max_running_requests")
        if match is None:
            match = self.tree_cache.match_prefix(self.cache_key(req), self.namespace(req))
        prefix_len = self._usable_prefix(req, match)
        self.req_to_token[row, :prefix_len] = match.kv_indices[:prefix_len]
        if self.window is not None:
            self.window.admit(row, match.kv_indices[:prefix_len])
        self.tree_cache.inc_lock_ref(match.last_node)
        req.req_pool_idx, req.last_node = row, match.last_node
        req.cached_len = req.kv_len = prefix_len
        if req.retractions == 0:
            req.cached_tokens = prefix_len
        return prefix_len

    def _ensure_free_pages(self, pages: int) -> bool:
        """Whether `pages` full pages (and as many window pages) are free, after evicting cache."""
        short = pages - self.allocator.num_free_pages
        if short > 0:
            self._evict(short * self.page_size)
        window = self.window
        # a cached page may have lost its window page: evict until enough are free or none is left,
        # then drop the window pages of cached pages outside every request's window
        while (
            window is not None
            and window.allocator.num_free_pages < pages
            and self.tree_cache.evictable_size()
        ):
            self._evict((pages - window.allocator.num_free_pages) * self.page_size)
        if window is not None and window.allocator.num_free_pages < pages:
            self._drop_cached_windows()
        return self._pages_free(pages)

    def _pages_free(self, pages: int) -> bool:
        """Whether `pages` full pages, and as many window pages, are free now."""
        return pages <= self.allocator.num_free_pages and (
            self.window is None or pages <= self.window.allocator.num_free_pages
        )

    @rank_consensus(result=True, name="window_drop")
    def _drop_cached_windows(self) -> int:
        assert self.window is not None
        return self.window.drop_unreferenced(self.req_to_token_pool.used_rows())

    def _slide(self, reqs: list[Req]) -> None:
        """Frees the window pages each request has moved a window past (positions only)."""
        if self.window is not None:
            for r in reqs:
                assert r.req_pool_idx is not None
                self.window.slide(self.req_to_token, r.req_pool_idx, r.kv_len)

    @rank_consensus(args=("num_tokens",), result=True, name="radix_evict")
    def _evict(self, num_tokens: int) -> int:
        return self.tree_cache.evict(num_tokens)

    def fits_decode(self, reqs: list[Req]) -> bool:
        self._slide(reqs)
        kv = [r.kv_len for r in reqs]
        return self._ensure_free_pages(self.allocator.pages_needed(kv, [k + 1 for k in kv]))

    def fits_free(self, reqs: list[Req], lens: list[int]) -> bool:
        """Whether `lens[i]` new tokens of each request fit in the free pages, evicting nothing."""
        self._slide(reqs)
        prefix = [r.kv_len for r in reqs]
        return self._pages_free(self.allocator.pages_needed(prefix, [k + n for k, n in zip(prefix, lens)]))

    @rank_consensus(args={"req": lambda r: (r.rid, r.kv_len), "kv_len": int}, name="kv_trim")
    def trim(self, req: Req, kv_len: int) -> None:
        """Frees the request's KV past its first `kv_len` tokens (a verify step's rejected drafts):
        the pages that start at or after kv_len; a partly kept page stays the request's, and its
        next tokens continue it."""
        assert req.req_pool_idx is not None and req.cached_len <= kv_len <= req.kv_len, (req.rid, kv_len)
        self.memory.free_tail(req.req_pool_idx, kv_len, req.kv_len)
        req.kv_len = kv_len

    def reserve_extend(self, reqs: list[Req], lens: list[int]) -> bool:
        """Allocates slots for `lens[i]` new tokens of each request (evicting cache if needed).
        On success `last_out_cache_loc` holds them; on failure nothing changed but window pages
        the requests had moved past."""
        self._slide(reqs)
        self._write_prompts(reqs)
        prefix = [r.kv_len for r in reqs]
        seq = [k + n for k, n in zip(prefix, lens)]
        if not self._ensure_free_pages(self.allocator.pages_needed(prefix, seq)):
            return False
        rows = [r.req_pool_idx for r in reqs]
        out = self.memory.alloc_extend(rows, prefix, seq)  # type: ignore[arg-type]
        if out is None:
            return False
        self.last_out_cache_loc = out
        return True

    def _write_prompts(self, reqs: list[Req]) -> None:
        """Hands the disk tier the whole blocks of each prompt computed by an earlier step (once per
        request: its KV covers the prompt), so a long generation's prompt is on disk before it ends."""
        if self.disk is None:
            return
        for req in reqs:
            if req.rid not in self._prompt_written and req.kv_len >= len(req.origin_input_ids):
                self._prompt_written.add(req.rid)
                self._write_blocks(req, len(req.origin_input_ids))

    def _write_blocks(self, req: Req, n: int) -> None:
        """Queues the whole blocks of req's first n tokens (computed, in req's row) for the disk."""
        disk = self._disk_for(req)
        if disk is None or req.req_pool_idx is None:
            return
        blocks = n // disk.block_tokens
        if blocks:
            names = disk.block_names(self.namespace(req), self.cache_key(req, n), blocks)
            disk.submit(names, self.req_to_token[req.req_pool_idx, : blocks * disk.block_tokens])

    def routed_experts(self, req: Req) -> str | None:
        """base64 of the int32 experts [tokens, layers, top_k] of the tokens req fed through the model
        (the prompt from routed_experts_start_len, every output token but the last), from their KV
        slots; None where the request holds no KV. Call before `release`."""
        routes = self.memory.routes
        if routes is None or req.req_pool_idx is None:
            return None
        fed = min(req.kv_len, len(req.origin_input_ids) + len(req.output_ids) - 1)
        return routes.read(self.req_to_token[req.req_pool_idx, req.routed_experts_start_len : fed])

    @rank_consensus(args={"req": lambda r: (r.rid, r.kv_len), "insert": bool}, name="radix_release")
    def release(self, req: Req, *, insert: bool) -> None:
        """Frees the request's row; its computed KV goes into the prefix cache (insert=True) or
        back to the allocator. Unlocks its prefix. A request never admitted is left alone."""
        self._disk_checked.discard(req.rid)
        self._prompt_written.discard(req.rid)
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        kv = self.req_to_token[row, : req.kv_len].clone()
        if insert:
            self._write_blocks(req, req.kv_len)  # the blocks' KV copied now, written in the background
            present = self.tree_cache.insert(self.cache_key(req, req.kv_len), kv, self.namespace(req))
            aligned = self.tree_cache.page_aligned_len(req.kv_len)
            # The cache already had kv[cached_len:present] from someone else, and never takes the
            # partial last page kv[aligned:]: both stay ours to free.
            if present > req.cached_len:
                self.memory.free_slots(kv[req.cached_len : present])
            if aligned < req.kv_len:
                self.memory.free_slots(kv[aligned:])
        elif req.kv_len > req.cached_len:
            self.memory.free_slots(kv[req.cached_len :])
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx, req.last_node = None, None
        req.kv_len = req.cached_len = 0

    def flush_cache(self, msg: FlushCacheReq, *, idle: bool) -> ControlReply:
        """/flush_cache: empties the prefix cache and frees its pages when no request is in flight
        (`idle`); with `msg.storage` (SGLang's /hicache/storage-backend/clear) deletes this rank's disk
        tier files instead, after the writes queued before it."""
        if msg.storage:
            if self.disk is None:
                return ControlReply(msg.request_id, False, {"message": "the hierarchical cache is off"})
            return ControlReply(msg.request_id, True, {"deleted_files": self.disk.clear()})
        if not idle:
            return ControlReply(msg.request_id, False, {"message": "requests are in flight"})
        self.tree_cache.reset()
        self.release_memory(evict=False)  # every page is free now
        return ControlReply(msg.request_id, True)

    @rank_consensus(args=("evict",), result=True, name="release_memory")
    def release_memory(self, *, evict: bool) -> int:
        """Gives the free pages' host memory back to the OS, after evicting every unlocked cache
        entry when `evict`; returns the bytes released. Called on every rank in the same iteration
        (a broadcast message asks), though only the eviction changes what a rank schedules."""
        start = time.perf_counter()
        evicted = self._evict(self.tree_cache.evictable_size()) if evict else 0
        released = self.kv_pool.release_pages(
            self.allocator.free_page_ids(),
            None if self.window is None else self.window.allocator.free_page_ids(),
        )
        logger.info(
            "KV memory released to the OS: %.1f MB in %.1f ms (%d cached tokens evicted, %d pages free)",
            released / 2**20,
            (time.perf_counter() - start) * 1e3,
            evicted,
            self.allocator.num_free_pages,
        )
        return evicted

    def page_counts(self) -> dict[str, int]:
        """KV pages free, allocated, and held by the prefix cache (some of those also by running
        requests; the other allocated pages belong to running requests alone)."""
        return {
            "free_pages": self.allocator.num_free_pages,
            "used_pages": self.allocator.num_used_pages,
            "cached_pages": self.tree_cache.total_size() // self.page_size,
        }

    def disk_counts(self) -> dict[str, float]:
        """The disk tier's counters as /metrics' gauges (srt/metrics.py DISK_GAUGES); none without it."""
        if self.disk is None:
            return {}
        s = self.disk.stats
        return {
            "disk_hit_tokens": s.hit_tokens,
            "disk_read_blocks": s.read_blocks,
            "disk_bad_blocks": s.bad_blocks,
            "disk_written_blocks": s.written_blocks,
            "disk_dropped_writes": s.dropped_writes,
            "disk_evicted_blocks": s.evicted_blocks,
            "disk_bytes": self.disk.bytes_on_disk(),
            "disk_read_seconds": s.read_s,
            "disk_write_seconds": s.write_s,
        }

    def stats(self, live: list[Req]) -> dict[str, Any]:
        return {
            "max_total_tokens": self.max_total_tokens,
            "page_size": self.page_size,
            "num_pages": self.allocator.num_pages,
            **self.page_counts(),
            **(
                {}
                if self.window is None
                else {
                    "window_pages": self.window.num_pages,
                    "window_free_pages": self.window.allocator.num_free_pages,
                    "window_used_pages": self.window.allocator.num_used_pages,
                }
            ),
            "free_tokens": self.allocator.num_free_tokens,
            "cached_tokens": self.tree_cache.total_size(),
            "evictable_tokens": self.tree_cache.evictable_size(),
            "protected_tokens": self.tree_cache.protected_size(),
            "kv_integrity_error": self.integrity_error(live),
            **({} if self.disk is None else {"disk_tier": self.disk.report()}),
        }

    def integrity_error(self, live: list[Req]) -> str | None:
        """None when free + cached + owned-by-live-requests pages == all pages, with no overlap."""
        parts = [self.tree_cache.all_kv_indices()] + [
            r.own_slots(self.req_to_token) for r in live if r.req_pool_idx is not None
        ]
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        pages = torch.unique(slots // self.page_size)
        tree_pages = torch.unique(parts[0] // self.page_size)
        owned = [torch.unique(p // self.page_size) for p in parts[1:]]
        overlap = sum(len(p) for p in owned) + len(tree_pages) - len(pages)
        try:
            self.allocator.check_integrity(expected_used_pages=len(pages))
        except RuntimeError as e:
            return str(e)
        if overlap:
            return f"{overlap} KV pages are held by two owners"
        if self.window is not None and (error := self.window.integrity_error(self.allocator.free_page_ids())):
            return error
        if (
            self.req_to_token_pool.num_free + len([r for r in live if r.req_pool_idx is not None])
            != self.req_to_token_pool.size
        ):
            return "request rows leaked"
        return None
