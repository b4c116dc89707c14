"""A radix prefix cache over token ids whose values are KV slots, with lock counts and LRU leaf eviction."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

import kvcanary_jax as kc

_EMPTY = np.zeros(0, np.int32)


class RadixNode:
    """An edge of the tree: `key` tokens whose KV lives in `value` slots. Locked while `lock_ref > 0`."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self, parent: RadixNode | None, key: tuple[int, ...], value: np.ndarray):
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: RadixNode) -> bool:  # for the eviction heap
        return self.last_access < other.last_access


class RadixCache:
    """SGLang's RadixCache in miniature.

    A path from the root spells a token prefix; the concatenated node values are the slots holding its KV.
    Running requests lock the node their matched prefix ends at (and so all its ancestors), which keeps those
    slots out of eviction. Eviction removes least-recently-used unlocked leaves and hands their slots back.
    """

    def __init__(self):
        self.root = RadixNode(None, (), _EMPTY)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[np.ndarray, RadixNode]:
        """Longest cached prefix of `tokens`: its slots (i32[m]) and the node it ends at.

        A match ending inside a node splits it, so locking the returned node covers exactly the matched slots.
        """
        node, i, parts = self.root, 0, []
        now = next(self._clock)
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            n = _common_len(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            node, i = child, i + n
        return (np.concatenate(parts) if parts else _EMPTY), node

    def insert(self, tokens: Sequence[int], slots: np.ndarray) -> int:
        """Caches `slots` as the KV of `tokens`; returns how many leading tokens were already cached.

        The tree keeps its own slots for that already-cached part: the caller owns (and must free) the
        duplicates it passed in at those positions, except those it got from the tree in the first place.
        """
        assert len(tokens) == len(slots)
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = RadixNode(node, tuple(tokens[i:]), np.array(slots[i:], np.int32))
                leaf.last_access = now
                node.children[tokens[i]] = leaf
                return i
            n = _common_len(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i

    def inc_lock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: RadixNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unbalanced radix unlock"
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_slots: int, free_fn: Callable[[np.ndarray], None]) -> int:
        """Evicts LRU unlocked leaves until at least `num_slots` slots were freed (or none are left).

        `free_fn` receives each evicted node's slots. Returns the number of slots freed.
        """
        heap = [n for n, _ in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            leaf = heapq.heappop(heap)
            free_fn(leaf.value)
            freed += len(leaf.value)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            # The parent may have just become an evictable leaf itself.
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def nodes(self) -> Iterator[tuple[RadixNode, int]]:
        """Depth-first (node, depth of its first token) over every node except the root."""
        stack = [(c, 0) for c in reversed(self.root.children.values())]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            stack.extend((c, depth + len(node.key)) for c in reversed(node.children.values()))

    def total_size(self) -> int:
        return sum(len(n.value) for n, _ in self.nodes())

    def evictable_size(self) -> int:
        return sum(len(n.value) for n, _ in self.nodes() if n.lock_ref == 0)

    def list_slots(self, *, unlocked_only: bool = False) -> kc.SweepEntries:
        """Every cached slot with its position and predecessor (SGLang's `walk_radix_cache_for_canary`).

        With `unlocked_only`, only slots of idle nodes (no running request holds them) are listed; their
        predecessors may still be locked slots.
        """
        return kc.walk_prefix_tree(
            self.root,
            children=lambda n: n.children.values(),
            slots=lambda n: n.value,
            include=(lambda n: n.lock_ref == 0) if unlocked_only else None,
        )

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cuts `node` after n tokens; returns the new upper half, which inherits the locks of the path."""
        upper = RadixNode(node.parent, node.key[:n], node.value[:n])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        node.parent, node.key, node.value = upper, node.key[n:], node.value[n:]
        return upper


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
