"""A radix-tree prefix cache (as in SGLang / mini-sglang), page-aligned.

Each non-root node is an edge holding a token slice (`key`, a positive multiple of `page_size`
long) and the page ids storing it (`value`, one id per page). Children are keyed by their first
page of tokens (an int when `page_size == 1`, else a tuple), so descending is one dict lookup.

Locking is by reference count: locking a node increments it and every ancestor up to the root,
so `ref_count(node) >= sum(ref_count(child))`. A node with `ref_count == 0` therefore has an
entirely unlocked subtree, which makes every page in an unlocked node evictable (leaves first).
Page totals are kept incrementally in two buckets, evictable (`ref_count == 0`) and protected.

LRU uses a monotonic counter, not wall time: each `match`/`insert` takes one tick and stamps every
node on its path with it, so runs are deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from minisgl_backend.kvcache.base import (BasePrefixCache, CacheHandle, InsertResult, MatchResult,
                                          as_token_list)


class RadixTreeNode:
    """One edge of the radix tree: a token slice, its page ids and its children."""

    __slots__ = ("key", "value", "children", "parent", "ref_count", "timestamp", "uid")

    def __init__(self, key: list[int], value: list[int], parent: RadixTreeNode | None, uid: int,
                 ref_count: int = 0, timestamp: int = 0) -> None:
        self.key = key
        self.value = value
        self.children: dict[Hashable, RadixTreeNode] = {}
        self.parent = parent
        self.ref_count = ref_count
        self.timestamp = timestamp
        self.uid = uid

    @property
    def num_pages(self) -> int:
        """Number of pages (page ids) this edge holds."""
        return len(self.value)

    def __repr__(self) -> str:
        return (
            f"RadixTreeNode(uid={self.uid}, tokens={len(self.key)}, pages={len(self.value)}, "
            f"ref={self.ref_count}, ts={self.timestamp}, children={len(self.children)})"
        )


class RadixCacheHandle(CacheHandle):
    """A handle to the tree node ending a cached prefix of `cached_len` tokens."""

    __slots__ = ("node",)

    def __init__(self, cached_len: int, node: RadixTreeNode) -> None:
        super().__init__(cached_len)
        self.node = node


class RadixPrefixCache(BasePrefixCache):
    """Page-aligned radix-tree prefix cache with ref-count locking and LRU leaf eviction."""

    def __init__(self, page_size: int = 1) -> None:
        super().__init__(page_size)
        self._next_uid = 0
        self._clock = 0
        self._root = self._new_node([], [], None)
        self._leaves: set[RadixTreeNode] = set()
        self._evictable = 0
        self._protected = 0

    # ----------------------------------------------------------------------------- public API
    def match(self, token_ids: Sequence[int]) -> MatchResult:
        """Return the longest cached page-aligned prefix of `token_ids` (splitting an edge if the
        match ends inside it) and refresh the path's LRU timestamps. Does not lock."""
        tokens = as_token_list(token_ids)
        node, matched, pages = self._walk(tokens, collect_pages=True)
        return MatchResult(RadixCacheHandle(matched, node), matched, pages)

    def lock(self, handle: CacheHandle) -> None:
        """Increment ref counts from the handle's node up to the root (root handle: no-op)."""
        node: RadixTreeNode | None = self._node_of(handle)
        while node is not None and node is not self._root:
            if node.ref_count == 0:
                self._evictable -= node.num_pages
                self._protected += node.num_pages
            node.ref_count += 1
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        """Decrement ref counts from the handle's node up to the root (root handle: no-op).

        Raises RuntimeError (changing nothing) if the handle is not locked.
        """
        node: RadixTreeNode | None = self._node_of(handle)
        if node is not self._root and node is not None and node.ref_count <= 0:
            raise RuntimeError(f"unlock of an unlocked handle ({handle!r})")
        while node is not None and node is not self._root:
            node.ref_count -= 1
            if node.ref_count == 0:
                self._protected -= node.num_pages
                self._evictable += node.num_pages
            node = node.parent

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Cache `token_ids` stored in `pages`; take only the pages of the not-yet-cached suffix
        (see `InsertResult.already_cached_len`)."""
        self._validate_insert(token_ids, pages)
        tokens = as_token_list(token_ids)
        node, matched, _ = self._walk(tokens, collect_pages=False)
        if matched < len(tokens):
            new_pages = as_token_list(pages)[matched // self.page_size :]
            node = self._add_leaf(node, tokens[matched:], new_pages)
        return InsertResult(RadixCacheHandle(len(tokens), node), matched)

    def evict(self, num_pages: int) -> list[int]:
        """Remove unlocked leaves, least recently used first, until >= `num_pages` pages are freed
        (a parent that becomes an unlocked leaf joins the candidates)."""
        self._validate_evict(num_pages)
        if num_pages == 0:
            return []
        if num_pages > self._evictable:
            raise RuntimeError(
                f"cannot evict {num_pages} pages: only {self._evictable} evictable "
                f"({self._protected} protected), short by {num_pages - self._evictable}"
            )
        heap = [(n.timestamp, n.uid, n) for n in self._leaves if n.ref_count == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages:
            if not heap:
                raise AssertionError("evictable page count exceeds what the tree can evict")
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed.extend(leaf.value)
            self._remove_leaf(leaf)
            if parent is not self._root and parent is not None and not parent.children and \
                    parent.ref_count == 0:
                heapq.heappush(heap, (parent.timestamp, parent.uid, parent))
        if self.events is not None:
            self.events.removed(freed)
        return freed

    def reset(self) -> list[int]:
        """Drop the whole tree (nothing may be locked) and return its pages."""
        if self._protected:
            raise RuntimeError(f"cannot reset the prefix cache: {self._protected} pages are "
                               "locked by running requests")
        pages = self.all_pages()
        for node in self._iter_nodes():
            if node is not self._root:
                node.parent = None  # handles to dropped nodes are stale; the root's stay valid
        self._root.children.clear()
        self._leaves.clear()
        self._evictable = 0
        if self.events is not None:
            self.events.cleared()
        return pages

    @property
    def evictable_pages(self) -> int:
        """Pages held in unlocked nodes (`ref_count == 0`)."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Pages held in locked nodes (`ref_count > 0`)."""
        return self._protected

    def all_pages(self) -> list[int]:
        """Every page id held by the tree (pre-order)."""
        pages: list[int] = []
        for node in self._iter_nodes():
            pages.extend(node.value)
        return pages

    def check_invariants(self) -> None:
        """Walk the whole tree and assert that all incremental bookkeeping matches it."""
        root = self._root
        assert not root.key and not root.value, "root must hold no tokens/pages"
        assert root.parent is None, "root must have no parent"
        evictable = protected = 0
        seen_pages: set[int] = set()
        leaves: set[RadixTreeNode] = set()
        for node in self._iter_nodes():
            self._check_children(node)
            if node is root:
                continue
            self._check_node_shape(node)
            if not node.children:
                leaves.add(node)
            if node.ref_count == 0:
                evictable += node.num_pages
            else:
                protected += node.num_pages
            for page in node.value:
                assert page not in seen_pages, f"page {page} is held twice"
                seen_pages.add(page)
        assert evictable == self._evictable, f"evictable {self._evictable} != walk {evictable}"
        assert protected == self._protected, f"protected {self._protected} != walk {protected}"
        assert leaves == self._leaves, "leaf set is out of sync with the tree"

    # ------------------------------------------------------------------------- tree walking
    def _walk(self, tokens: list[int], collect_pages: bool) -> tuple[RadixTreeNode, int, list[int]]:
        """(deepest matched node, matched tokens, their page ids if collected) along `tokens`,
        splitting the last edge if the match ends inside it; stamps the path with a fresh tick."""
        page_size = self.page_size
        limit = len(tokens) - len(tokens) % page_size
        now = self._tick()
        node = self._root
        node.timestamp = now
        matched = 0
        pages: list[int] = []
        while matched < limit:
            child = node.children.get(self._child_key(tokens, matched))
            if child is None:
                break
            length = self._common_len(child.key, tokens, matched, limit)
            ends_inside = length < len(child.key)
            if ends_inside:
                child = self._split(child, length)
            child.timestamp = now
            if collect_pages:
                pages.extend(child.value)
            node = child
            matched += length
            if ends_inside:
                break
        return node, matched, pages

    def _common_len(self, key: list[int], tokens: list[int], start: int, limit: int) -> int:
        """Page-aligned length of the common prefix of `key` and `tokens[start:limit]` (the first
        page matches: it selected the child); a binary search over pages of slice compares."""
        page_size = self.page_size
        end = min(len(key), limit - start)
        if end == len(key):
            if key == tokens[start : start + end]:
                return end
        elif key[:end] == tokens[start : start + end]:
            return end
        good, bad = 1, end // page_size  # pages: [0, good) match, [0, bad) does not
        while bad - good > 1:
            mid = (good + bad) // 2
            lo, hi = good * page_size, mid * page_size
            if key[lo:hi] == tokens[start + lo : start + hi]:
                good = mid
            else:
                bad = mid
        return good * page_size

    def _child_key(self, tokens: list[int], start: int) -> Hashable:
        """Dict key of the edge beginning at `tokens[start]`: its first page of tokens."""
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    # ---------------------------------------------------------------------- tree mutation
    def _new_node(self, key: list[int], value: list[int], parent: RadixTreeNode | None,
                  ref_count: int = 0, timestamp: int = 0) -> RadixTreeNode:
        self._next_uid += 1
        return RadixTreeNode(key, value, parent, self._next_uid, ref_count, timestamp)

    def _split(self, child: RadixTreeNode, length: int) -> RadixTreeNode:
        """Split `child` after `length` tokens; the new upper node, returned, inherits its ref
        count and timestamp, so locks and page totals stay correct."""
        parent = child.parent
        assert parent is not None and 0 < length < len(child.key) and length % self.page_size == 0
        num_pages = length // self.page_size
        upper = self._new_node(
            child.key[:length], child.value[:num_pages], parent, child.ref_count, child.timestamp
        )
        child.key = child.key[length:]
        child.value = child.value[num_pages:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        return upper

    def _add_leaf(self, parent: RadixTreeNode, key: list[int], value: list[int]) -> RadixTreeNode:
        """Link a new unlocked leaf under `parent` and account its pages as evictable."""
        leaf = self._new_node(key, value, parent, 0, self._clock)
        parent.children[self._child_key(key, 0)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._evictable += leaf.num_pages
        if self.events is not None:
            self.events.stored(parent.value[-1] if parent.value else None, key, value)
        return leaf

    def _remove_leaf(self, leaf: RadixTreeNode) -> None:
        """Unlink an unlocked leaf; its parent becomes a leaf if it has no children left."""
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.ref_count == 0
        del parent.children[self._child_key(leaf.key, 0)]
        self._leaves.discard(leaf)
        self._evictable -= leaf.num_pages
        leaf.parent = None  # marks the node (and any handle to it) as stale
        if parent is not self._root and not parent.children:
            self._leaves.add(parent)

    # ------------------------------------------------------------------------------ helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _node_of(self, handle: CacheHandle) -> RadixTreeNode:
        """The node behind `handle`; rejects foreign and stale (evicted) handles."""
        if not isinstance(handle, RadixCacheHandle):
            raise TypeError(f"expected a RadixCacheHandle, got {type(handle).__name__}")
        node = handle.node
        if node is not self._root and node.parent is None:
            raise ValueError(f"stale handle: its node was evicted ({handle!r})")
        return node

    def _iter_nodes(self) -> list[RadixTreeNode]:
        """All nodes including the root, pre-order."""
        nodes: list[RadixTreeNode] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _check_children(self, node: RadixTreeNode) -> None:
        """Assert the children dict of `node` is keyed and linked consistently."""
        child_refs = 0
        for key, child in node.children.items():
            assert child.parent is node, f"{child!r} does not point back to its parent"
            assert key == self._child_key(child.key, 0), f"{child!r} is filed under a wrong key"
            assert child.ref_count >= 0, f"{child!r} has a negative ref count"
            child_refs += child.ref_count
        if node is not self._root:
            assert node.ref_count >= child_refs, f"{node!r} has fewer refs than its children"

    def _check_node_shape(self, node: RadixTreeNode) -> None:
        """Assert a non-root node's key/value sizes are consistent and page-aligned."""
        assert node.ref_count >= 0, f"{node!r} has a negative ref count"
        assert len(node.key) > 0, f"{node!r} is empty"
        assert len(node.key) % self.page_size == 0, f"{node!r} is not page-aligned"
        assert len(node.value) == len(node.key) // self.page_size, f"{node!r} pages != tokens"
