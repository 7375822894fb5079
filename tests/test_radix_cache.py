import random
from collections.abc import Sequence

import pytest
import torch

from mem_cache.radix_cache import BASE, Namespace, NoPrefixCache, RadixCache, TreeNode


class Slots:
    """Fake allocator: hands out fresh slot ids and records what the cache frees."""

    def __init__(self) -> None:
        self.next_slot = 0
        self.freed: list[int] = []

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64
        self.freed.extend(slots.tolist())


def make(page_size: int = 1) -> tuple[RadixCache, Slots]:
    slots = Slots()
    return RadixCache(slots.free, page_size=page_size), slots


def kv(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def test_empty_match() -> None:
    cache, _ = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.kv_indices.dtype == torch.int64 and m.kv_indices.tolist() == []
    assert m.last_node is cache.root
    assert cache.match_prefix([]).kv_indices.tolist() == []
    assert cache.total_size() == 0 and cache.all_kv_indices().tolist() == []


def test_full_and_partial_match_splits_node() -> None:
    cache, _ = make()
    assert cache.insert([1, 2, 3, 4], kv(10, 11, 12, 13)) == 0
    full = cache.match_prefix([1, 2, 3, 4, 5])
    assert full.kv_indices.tolist() == [10, 11, 12, 13]
    assert full.last_node.key == (1, 2, 3, 4)

    part = cache.match_prefix([1, 2, 9])
    assert part.kv_indices.tolist() == [10, 11]
    assert part.last_node.key == (1, 2)  # split at the match boundary
    assert [c.key for c in part.last_node.children.values()] == [(3, 4)]
    assert full.last_node.key == (3, 4) and full.last_node.parent is part.last_node
    # Splitting moves no slots and changes no sizes.
    assert cache.total_size() == 4 and sorted(cache.all_kv_indices().tolist()) == [10, 11, 12, 13]
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices.tolist() == [10, 11, 12, 13]
    assert cache.match_prefix([2, 1]).kv_indices.tolist() == []


def test_insert_returns_already_cached_prefix_len() -> None:
    cache, _ = make()
    assert cache.insert([1, 2, 3], kv(0, 1, 2)) == 0
    assert cache.insert([1, 2, 3], kv(5, 6, 7)) == 3
    assert cache.insert([1, 2, 4, 5], kv(8, 9, 10, 11)) == 2  # diverges inside a node
    assert cache.insert([1], kv(12)) == 1
    assert cache.insert([7, 8], kv(13, 14)) == 0
    # Only the new suffixes were taken: the old slots stay, duplicates were not stored.
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == [0, 1, 2]
    assert cache.match_prefix([1, 2, 4, 5]).kv_indices.tolist() == [0, 1, 10, 11]
    assert sorted(cache.all_kv_indices().tolist()) == [0, 1, 2, 10, 11, 13, 14]
    assert cache.evictable_size() == 7


def test_insert_copies_slots() -> None:
    cache, _ = make()
    row = kv(4, 5, 6)
    cache.insert([1, 2, 3], row)
    row[:] = -1  # the caller reuses its req_to_token row
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == [4, 5, 6]


def test_insert_rejects_bad_kv_indices() -> None:
    cache, _ = make()
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert([1, 2], kv(1))
    with pytest.raises(ValueError, match="int64"):
        cache.insert([1, 2], torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(lambda s: None, page_size=0)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)


def test_lru_eviction_follows_logical_access_order() -> None:
    cache, slots = make()
    cache.insert([1, 1], kv(10, 11))
    cache.insert([2, 2], kv(20, 21))
    cache.insert([3, 3], kv(30, 31))
    cache.match_prefix([1, 1])  # 1 is now the most recent; 2 the oldest
    assert cache.evict(1) == 2
    assert slots.freed == [20, 21]
    cache.insert([2, 2], kv(22, 23))  # re-inserted: now newest
    assert cache.evict(2) == 2
    assert slots.freed == [20, 21, 30, 31]
    assert cache.evict(4) == 4
    assert slots.freed == [20, 21, 30, 31, 10, 11, 22, 23]
    assert cache.total_size() == 0 and cache.evict(1) == 0


def test_split_leaves_unmatched_tail_old() -> None:
    cache, slots = make()
    cache.insert([1, 2, 3], kv(0, 1, 2))
    cache.insert([5], kv(3))
    cache.match_prefix([1, 2])  # touches [1, 2] only, not the split-off [3]
    assert cache.evict(1) == 1 and slots.freed == [2]


def test_eviction_goes_leaf_first_then_parent() -> None:
    cache, slots = make()
    cache.insert([1, 2, 3], kv(0, 1, 2))
    cache.insert([1, 2, 4], kv(0, 1, 3))
    cache.insert([5], kv(4))
    assert cache.evict(2) == 2  # leaves [3] (older) then [4]; [5] is newest
    assert slots.freed == [2, 3]
    assert cache.evict(3) == 3  # now [1, 2] is an old leaf: it goes before [5]
    assert slots.freed == [2, 3, 0, 1, 4]


def test_locked_nodes_are_never_evicted_and_sizes_follow_locks() -> None:
    cache, slots = make()
    cache.insert([1, 2, 3, 4], kv(0, 1, 2, 3))
    cache.insert([1, 2, 5], kv(0, 1, 4))
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.inc_lock_ref(m.last_node)  # a second request on the same prefix
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)

    assert cache.evict(100) == 1
    assert slots.freed == [4]
    assert cache.evict(100) == 0 and (cache.evictable_size(), cache.protected_size()) == (0, 4)

    # A split under a lock keeps both halves locked.
    inner = cache.match_prefix([1, 2, 3]).last_node
    assert inner.lock_ref == 2 and cache.protected_size() == 4
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()

    cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == 0
    cache.dec_lock_ref(m.last_node)
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == 4
    assert sorted(slots.freed) == [0, 1, 2, 3, 4]


def test_lock_on_prefix_protects_only_the_path() -> None:
    cache, slots = make()
    cache.insert([1, 2, 3], kv(0, 1, 2))
    m = cache.match_prefix([1, 2])
    cache.inc_lock_ref(m.last_node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 2)
    assert cache.evict(3) == 1 and slots.freed == [2]


def test_evict_frees_each_slot_once_and_accounts_for_all() -> None:
    cache, slots = make()
    owned: list[int] = []
    for seq in ([1, 2, 3], [1, 2, 4], [1, 5], [6, 7, 8, 9], [6, 7]):
        slot_ids = slots.alloc(len(seq))
        done = cache.insert(seq, slot_ids)
        owned += slot_ids[done:].tolist()
    assert cache.evict(4) >= 4
    held = cache.all_kv_indices().tolist()
    assert len(slots.freed) == len(set(slots.freed))
    assert sorted(slots.freed + held) == sorted(owned)
    cache.reset()
    assert sorted(slots.freed) == sorted(owned) and cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == []


def test_page_size_truncates_to_whole_pages() -> None:
    cache, _ = make(page_size=4)
    assert cache.insert(list(range(10)), torch.arange(100, 110)) == 0
    assert cache.total_size() == 8  # the last partial page stays with the caller
    assert cache.match_prefix(list(range(10))).kv_indices.tolist() == list(range(100, 108))
    assert cache.match_prefix(list(range(7))).kv_indices.tolist() == list(range(100, 104))
    assert cache.match_prefix([0, 1, 2]).kv_indices.tolist() == []
    # Diverging at token 6 keeps only the first page and splits on the page boundary.
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7])
    assert m.kv_indices.tolist() == [100, 101, 102, 103] and m.last_node.key == (0, 1, 2, 3)
    assert cache.insert([0, 1, 2, 3, 4, 5, 99, 7, 8], torch.arange(200, 209)) == 4
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7]).kv_indices.tolist() == [
        100,
        101,
        102,
        103,
        204,
        205,
        206,
        207,
    ]
    assert cache.total_size() == 12 and all(len(n.key) % 4 == 0 for n in cache._nodes())


def test_no_prefix_cache_frees_what_radix_cache_would_take() -> None:
    slots = Slots()
    cache = NoPrefixCache(slots.free, page_size=2)
    m = cache.match_prefix([1, 2, 3])
    assert m.kv_indices.tolist() == []
    cache.inc_lock_ref(m.last_node)
    assert cache.insert([1, 2, 3], kv(7, 8, 9)) == 0
    assert slots.freed == [7, 8]  # whole pages; the partial page [9] stays with the caller
    cache.dec_lock_ref(m.last_node)
    assert cache.total_size() == 0 and cache.evict(10) == 0 and cache.all_kv_indices().numel() == 0


Pages = dict[tuple[int, ...], tuple[int, ...]]  # cached page-aligned prefix -> its last page's slots


def reference_match(ref: Pages, seq: Sequence[int], page_size: int) -> list[int]:
    """Slots of the longest cached whole-page prefix of ``seq``."""
    out: list[int] = []
    for end in range(page_size, len(seq) + 1, page_size):
        if tuple(seq[:end]) not in ref:
            break
        out += ref[tuple(seq[:end])]
    return out


@pytest.mark.parametrize("page_size", [1, 2])
def test_randomized_against_reference_model(page_size: int) -> None:
    rng = random.Random(1234 + page_size)
    cache, slots = make(page_size)
    ref: Pages = {}
    locked: list[tuple[TreeNode, list[int]]] = []
    owned: set[int] = set()  # every slot the cache ever took ownership of

    for _ in range(800):
        op = rng.random()
        seq = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        n = len(seq) // page_size * page_size
        if op < 0.4:
            slot_ids = slots.alloc(len(seq))
            done = cache.insert(seq, slot_ids)
            assert done == len(reference_match(ref, seq, page_size))
            for end in range(done + page_size, n + 1, page_size):
                ref[tuple(seq[:end])] = tuple(slot_ids[end - page_size : end].tolist())
            owned |= set(slot_ids[done:n].tolist())
        elif op < 0.7:
            m = cache.match_prefix(seq)
            assert m.kv_indices.tolist() == reference_match(ref, seq, page_size)
            if rng.random() < 0.3:
                cache.inc_lock_ref(m.last_node)
                locked.append((m.last_node, m.kv_indices.tolist()))
        elif op < 0.85 and locked:
            node, _ = locked.pop(rng.randrange(len(locked)))
            cache.dec_lock_ref(node)
        else:
            before = len(slots.freed)
            want = rng.randrange(1, 8)
            got = cache.evict(want)
            newly = set(slots.freed[before:])
            assert got == len(newly) and (got >= want or cache.evictable_size() == 0)
            assert not newly & {s for _, kvs in locked for s in kvs}
            for prefix in [p for p, page in ref.items() if newly & set(page)]:
                assert set(ref.pop(prefix)) <= newly  # pages go whole
            # Leaves first: nothing left in the reference hangs below an evicted prefix.
            assert all(p[:-page_size] in ref for p in ref if len(p) > page_size)

        held = cache.all_kv_indices().tolist()
        assert len(held) == len(set(held)) == cache.total_size() == page_size * len(ref)
        assert set(held) == {s for page in ref.values() for s in page}
        assert len(slots.freed) == len(set(slots.freed))
        assert set(slots.freed) | set(held) == owned and not set(slots.freed) & set(held)
        assert cache.protected_size() == len(
            {tuple(kvs[:i]) for _, kvs in locked for i in range(1, len(kvs) + 1)}
        )
    assert len(owned) > 100 and len(slots.freed) > 50  # the run exercised eviction


def run_ops(cache: RadixCache, seed: int) -> list[str]:
    rng = random.Random(seed)
    slots = Slots()
    digests = []
    for _ in range(200):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        op = rng.randrange(4)
        if op == 0:
            cache.insert(seq, slots.alloc(len(seq)))
        elif op == 1:
            cache.inc_lock_ref(cache.match_prefix(seq).last_node)
        elif op == 2:
            cache.match_prefix(seq)
        else:
            cache.evict(rng.randrange(1, 6))
        digests.append(cache.digest())
    return digests


def test_same_operations_give_same_digests() -> None:
    a = run_ops(RadixCache(lambda s: None), seed=7)
    b = run_ops(RadixCache(lambda s: None), seed=7)
    c = run_ops(RadixCache(lambda s: None), seed=8)
    assert a == b
    assert a != c
    assert len(set(a)) > 100  # the digest tracks the state, it is not a constant


def test_digest_sees_access_order() -> None:
    a, _ = make()
    b, _ = make()
    for cache in (a, b):
        cache.insert([1], kv(0))
        cache.insert([2], kv(1))
    a.match_prefix([1])
    b.match_prefix([2])
    # Same contents, different LRU state: they would evict differently, so they must differ.
    assert a.digest() != b.digest()


def test_digest_sees_slots() -> None:
    a, _ = make()
    b, _ = make()
    a.insert([1, 2], kv(0, 1))
    b.insert([1, 2], kv(0, 2))
    assert a.digest() != b.digest()


def test_namespaces_never_share_kv() -> None:
    """A LoRA adapter's KV of the same tokens is another prefix (ARCHITECTURE.md, "What the prefix
    cache's key holds"): a lookup in one namespace never returns another's slots; eviction, locks,
    reset and the digest span every namespace."""
    cache, slots = make(page_size=2)
    adapter = Namespace(adapter=1)
    assert cache.insert([1, 2, 3, 4], kv(10, 11, 12, 13)) == 0
    assert cache.match_prefix([1, 2, 3, 4], adapter).kv_indices.tolist() == []
    assert cache.insert([1, 2, 3, 4], kv(20, 21, 22, 23), adapter) == 0  # not "already cached"
    assert cache.match_prefix([1, 2, 3, 4, 5], adapter).kv_indices.tolist() == [20, 21, 22, 23]
    assert cache.match_prefix([1, 2, 3, 4, 5], BASE).kv_indices.tolist() == [10, 11, 12, 13]
    assert cache.match_prefix([1, 2], Namespace(adapter=1, weight_version=1)).kv_indices.tolist() == []
    digests = []
    for namespace in (adapter, Namespace(adapter=2)):  # the same calls, another adapter
        same, _ = make(page_size=2)
        same.insert([1, 2], kv(10, 11))
        same.insert([1, 2], kv(20, 21), namespace)
        digests.append(same.digest())
    assert digests[0] != digests[1]  # the namespace is part of the state ranks compare

    locked = cache.match_prefix([1, 2, 3, 4], adapter).last_node
    cache.inc_lock_ref(locked)
    assert cache.protected_size() == 4 and cache.evictable_size() == 4
    assert cache.evict(8) == 4 and slots.freed == [10, 11, 12, 13]  # only the unlocked base prefix
    cache.dec_lock_ref(locked)
    assert cache.evict(8) == 4 and slots.freed[4:] == [20, 21, 22, 23]
    cache.insert([5, 6], kv(30, 31), adapter)
    cache.reset()
    assert slots.freed[8:] == [30, 31] and cache.total_size() == 0
