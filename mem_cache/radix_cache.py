"""Prefix caches: map token-id sequences to the KV slots that already hold their keys/values.

Ownership contract shared by every implementation (so the scheduler's code is the same with
the cache on or off):

- ``match_prefix`` hands out slots the cache owns; a running request that reads them must
  ``inc_lock_ref`` the returned node and ``dec_lock_ref`` it when it is done.
- ``insert(token_ids, kv_indices)`` returns ``prefix_len``. With ``n = page_aligned_len(len)``::

      kv_indices: [0 ........ prefix_len) [prefix_len ...... n) [n ...... len)
                   caller keeps (already     cache takes           caller keeps
                   cached: duplicates, or    ownership             (partial page)
                   the request's own match)

  so a finished request frees ``kv_indices[cached_len:prefix_len]`` and ``kv_indices[n:]``.
  The cache may free what it owns (through ``free_slots``) whenever it is unlocked, so only
  insert slots the caller no longer needs, or re-match and lock them straight after.

Every decision is deterministic: access times come from a logical clock, eviction ties break on
node ids, and traversals sort children by key, so replicated ranks stay identical.

A prefix's identity is its token ids within a ``Namespace``: what besides the ids changes their KV
(the LoRA adapter, the weights' version). Each namespace has its own root, so a lookup never
crosses into another's KV; eviction, locking and the digest span them all.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FreeSlots = Callable[[torch.Tensor], None]


@dataclass(frozen=True, order=True)
class Namespace:
    """What besides token ids a prefix's KV depends on, for the whole sequence: the adapter that
    computed it (0: the base model; srt/lora_config.py) and the version of the weights (the count of
    updates from disk: scheduler/weight_registry.py). A feature that changes KV adds a field here,
    never a second cache."""

    adapter: int = 0
    weight_version: int = 0


BASE = Namespace()


@dataclass(eq=False)
class TreeNode:
    """One edge of the radix tree: ``key`` tokens whose KV lives in ``value`` slots."""

    id: int
    key: tuple[int, ...] = ()
    value: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: TreeNode | None = None
    # Keyed by the node's first page of tokens; never iterated unsorted.
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def sorted_children(self) -> list[TreeNode]:
        return [self.children[k] for k in sorted(self.children)]


@dataclass
class MatchResult:
    kv_indices: torch.Tensor  # int64, one slot per matched token
    last_node: TreeNode  # deepest matched node; lock it to keep the match alive


class BasePrefixCache(ABC):
    def __init__(self, free_slots: FreeSlots, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.free_slots = free_slots
        self.page_size = page_size
        self.device = torch.device(device)

    def page_aligned_len(self, num_tokens: int) -> int:
        """Largest multiple of ``page_size`` not above ``num_tokens``: what insert/match keep."""
        return num_tokens // self.page_size * self.page_size

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], namespace: Namespace = BASE) -> MatchResult:
        """Longest cached whole-page prefix of ``token_ids`` in ``namespace``. Mutates: may split a
        node so the match ends on a node boundary; bumps access times on the path. Locks nothing."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor, namespace: Namespace = BASE) -> int:
        """Cache the whole pages of ``token_ids`` with their slots in ``namespace``; returns how many
        tokens were already cached there (see the module docstring for who owns which slots
        afterwards). Locks nothing. Raises ``ValueError`` if ``kv_indices`` is not a 1-D int64 tensor on the cache's
        device with one slot per token."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one count per call)."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``. Raises ``RuntimeError`` if the path is not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves through ``free_slots`` until at least
        ``num_tokens`` are freed or nothing is evictable; returns tokens freed. Raises
        ``ValueError`` if ``num_tokens < 0``."""

    @abstractmethod
    def reset(self) -> None:
        """Free every cached slot through ``free_slots`` and empty the cache. Raises
        ``RuntimeError`` (and changes nothing) if any node is locked."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens on unlocked nodes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens on locked nodes."""

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def all_kv_indices(self) -> torch.Tensor:
        """Every slot the cache holds (for the "free + cached + in use == total" check)."""

    @abstractmethod
    def digest(self) -> str:
        """Hex sha256 of the cache's full decision-relevant state, for cross-rank comparison."""


class NoPrefixCache(BasePrefixCache):
    """``--disable-radix-cache``: matches nothing and frees what it is given at once."""

    def __init__(self, free_slots: FreeSlots, page_size: int = 1, device: str | torch.device = "cpu"):
        super().__init__(free_slots, page_size, device)
        self.root = TreeNode(id=0)

    def match_prefix(self, token_ids: Sequence[int], namespace: Namespace = BASE) -> MatchResult:
        return MatchResult(self._empty(), self.root)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor, namespace: Namespace = BASE) -> int:
        """Takes ownership of the whole pages like RadixCache does, and frees them at once."""
        _check_kv(kv_indices, len(token_ids), self.device)
        owned = kv_indices[: self.page_aligned_len(len(token_ids))]
        if len(owned):
            self.free_slots(owned)
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return 0

    def reset(self) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def all_kv_indices(self) -> torch.Tensor:
        return self._empty()

    def digest(self) -> str:
        return hashlib.sha256(b"").hexdigest()


class RadixCache(BasePrefixCache):
    """Radix trees over token ids, one per namespace. Every node's key length is a multiple of
    ``page_size`` and children are keyed by their first page, so keys are compared page by page."""

    def __init__(self, free_slots: FreeSlots, page_size: int = 1, device: str | torch.device = "cpu"):
        super().__init__(free_slots, page_size, device)
        self._clear()

    def _clear(self) -> None:
        """Forget everything without freeing anything."""
        self._node_ids = itertools.count(1)
        self._clock = 0  # logical time: one tick per match/insert, identical on every rank
        self.roots: dict[Namespace, TreeNode] = {BASE: TreeNode(id=0, value=self._empty())}
        self._evictable = 0
        self._protected = 0

    @property
    def root(self) -> TreeNode:
        """The base namespace's root."""
        return self.roots[BASE]

    def _root(self, namespace: Namespace) -> TreeNode:
        """The namespace's root, made on its first use (an id from the node counter: every rank makes
        it in the same call)."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TreeNode(id=next(self._node_ids), value=self._empty())
        return root

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode) -> TreeNode:
        node = TreeNode(id=next(self._node_ids), key=key, value=value, parent=parent)
        parent.children[key[: self.page_size]] = node
        return node

    def _walk(
        self, key: tuple[int, ...], now: int, root: TreeNode
    ) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``key`` (page-aligned) down from ``root`` as far as the tree has it, splitting the
        last node if the match ends inside it. Returns (deepest node, matched tokens, slot tensors
        on the path)."""
        node, matched, values = root, 0, []
        while matched < len(key):
            child = node.children.get(key[matched : matched + self.page_size])
            if child is None:
                break
            # At least one page in common: the first page is the child's dict key.
            common = self.page_aligned_len(_common_prefix_len(child.key, key[matched:]))
            if common < len(child.key):
                child = self._split(child, common)  # the next lookup then misses or key ends
            child.last_access = now  # after the split: the unmatched tail keeps its old time
            values.append(child.value)
            node, matched = child, matched + common
        return node, matched, values

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens; the new upper part is returned. ``node`` keeps the
        tail, so references held by lockers keep meaning the same tokens."""
        assert node.parent is not None and 0 < at < len(node.key)
        upper = self._new_node(node.key[:at], node.value[:at], node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def match_prefix(self, token_ids: Sequence[int], namespace: Namespace = BASE) -> MatchResult:
        key = tuple(token_ids[: self.page_aligned_len(len(token_ids))])
        node, _, values = self._walk(key, self._tick(), self._root(namespace))
        return MatchResult(torch.cat(values) if values else self._empty(), node)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor, namespace: Namespace = BASE) -> int:
        _check_kv(kv_indices, len(token_ids), self.device)
        n = self.page_aligned_len(len(token_ids))
        key = tuple(token_ids[:n])
        now = self._tick()
        node, prefix_len, _ = self._walk(key, now, self._root(namespace))
        if prefix_len < n:
            # Clone: the caller's tensor is often a view of a req_to_token row that gets reused.
            leaf = self._new_node(key[prefix_len:], kv_indices[prefix_len:n].clone(), node)
            leaf.last_access = now
            self._evictable += len(leaf.key)
        return prefix_len

    def _path_to_root(self, node: TreeNode) -> Iterator[TreeNode]:
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:  # a root has no parent
            yield cur
            cur = cur.parent

    def inc_lock_ref(self, node: TreeNode) -> None:
        for cur in self._path_to_root(node):
            if cur.lock_ref == 0:
                self._evictable -= len(cur.key)
                self._protected += len(cur.key)
            cur.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        path = list(self._path_to_root(node))
        if any(cur.lock_ref == 0 for cur in path):
            raise RuntimeError(f"dec_lock_ref on node {node.id}, which is not locked")
        for cur in path:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._evictable += len(cur.key)
                self._protected -= len(cur.key)

    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        # An unlocked node has no locked descendants, so evicting leaves first is always possible.
        heap = [(n.last_access, n.id, n) for n in self._nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            freed.append(node.value)
            num_freed += len(node.key)
            self._evictable -= len(node.key)
            if parent.parent is not None and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.free_slots(torch.cat(freed))
        return num_freed

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} tokens locked by running requests")
        slots = self.all_kv_indices()
        if len(slots):
            self.free_slots(slots)
        self._clear()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    @staticmethod
    def _tree(root: TreeNode) -> Iterator[TreeNode]:
        """``root`` and its descendants, pre-order, children sorted by key."""
        stack = [root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.sorted_children()))

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the roots, namespaces in order: the same order on every rank."""
        for namespace in sorted(self.roots):
            yield from itertools.islice(self._tree(self.roots[namespace]), 1, None)

    def all_kv_indices(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty()

    def digest(self) -> str:
        """Covers shape, keys, slots, lock counts and access times (all deterministic)."""
        h = hashlib.sha256(struct.pack("<q", self._clock))
        for namespace in sorted(self.roots):
            root = self.roots[namespace]
            h.update(struct.pack("<3q", namespace.adapter, namespace.weight_version, root.id))
            for node in self._tree(root):
                self._digest_node(h, node)
        return h.hexdigest()

    @staticmethod
    def _digest_node(h: Any, node: TreeNode) -> None:
        h.update(
            struct.pack(
                f"<4q{len(node.key)}q",
                len(node.children),
                node.lock_ref,
                node.last_access,
                len(node.key),
                *node.key,
            )
        )
        h.update(node.value.cpu().numpy().tobytes())

    def pretty_print(self) -> str:
        lines = []
        for node in self._nodes():
            depth = sum(1 for _ in self._path_to_root(node)) - 1
            lines.append(
                f"{'  ' * depth}#{node.id} key={list(node.key)} kv={node.value.tolist()} "
                f"lock={node.lock_ref} t={node.last_access}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, evictable={self._evictable}, "
            f"protected={self._protected})"
        )


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _check_kv(kv_indices: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    if kv_indices.dtype != torch.int64 or kv_indices.dim() != 1 or len(kv_indices) != num_tokens:
        raise ValueError(
            f"kv_indices must be a 1-D int64 tensor with one slot per token ({num_tokens}), "
            f"got dtype={kv_indices.dtype} shape={tuple(kv_indices.shape)}"
        )
    if kv_indices.device.type != device.type or (
        device.index is not None and kv_indices.device.index != device.index
    ):
        raise ValueError(f"kv_indices is on {kv_indices.device}, the cache is on {device}")
