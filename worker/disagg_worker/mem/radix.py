"""Page-granular radix prefix cache.

The tree maps token prefixes to the KV pages that hold them. Every edge carries a whole
number of pages (`len(node.key) == len(node.pages) * page_size`), children are keyed by the
tokens of their first page, and a node is split at a page boundary when a new key diverges
inside it. A partial page is never cached nor matched.

Ownership: a page is owned either by the tree or by a request, never both. The tree frees
its pages to the allocator only on `evict` and `reset`. A request that matched a prefix
`lock`s the returned node so those pages cannot be evicted while it reads them, and
`unlock`s it when done. A lock counts on the node and on every ancestor, so a node's
lock count is at least that of any descendant and an unlocked node has no locked
descendants: evicting unlocked leaves never strands a locked node.

With `record_events` every page also has a name, a chained hash of the tokens up to it (`kv_events.py`),
kept per node, and the cache records what it stores and evicts under those names for `take_events` to hand on.
A `listener` (the tiers under the cache, `engine/tiers.py`) is told, under the same names, of the pages the
tree takes, hits and evicts, each while the page still holds its KV.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .allocator import PageAllocator
from .kv_events import ROOT, Event, page_hashes


class Listener(Protocol):
    def stored(self, names: list[int], pages: list[int]) -> None: ...
    def hit(self, names: list[int], pages: list[int]) -> None: ...
    def evicted(self, names: list[int], pages: list[int]) -> None: ...


class Node:
    __slots__ = ("key", "pages", "names", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None, names: list[int] | None = None):
        self.key = key
        self.pages = pages
        self.names = names or []  # one per page: its chained hash (kv_events.page_hash)
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0

    @property
    def up(self) -> Node:
        """The parent of an attached non-root node."""
        if self.parent is None:
            raise ValueError("the root (or a detached node) has no parent")
        return self.parent


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix: `pages` hold `num_tokens == len(pages) * page_size` tokens,
    and `node` is the tree node that ends exactly there (pass it to `lock`/`unlock`)."""

    pages: list[int]
    num_tokens: int
    node: Node


@dataclass
class CacheStats:
    hit_tokens: int = 0
    queried_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        enabled: bool = True,
        record_events: bool = False,
        names_key: bytes = b"",
    ):
        """`record_events`: name every page and record what is stored and evicted (`kv_events.py`), with
        `names_key` keying the names (the model's secret: `keys.kv_names`)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.enabled = enabled
        self.stats = CacheStats()
        self._root = Node((), [], None)
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self.record_events = record_events
        self.names_key = names_key
        self._events: list[Event] = []
        self.listener: Listener | None = None

    @property
    def names_pages(self) -> bool:
        """Whether pages are named (for the events, or for the tiers under the cache)."""
        return self.record_events or self.listener is not None

    def take_events(self) -> list[Event]:
        """The events recorded since the last call (none unless `record_events`)."""
        events, self._events = self._events, []
        return events

    @property
    def root(self) -> Node:
        return self._root

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def total_pages(self) -> int:
        return self._evictable + self._protected

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `tokens` in whole pages; refreshes LRU along the path.

        The whole of `tokens` may match; a caller that must compute at least one token
        should pass `tokens[:-1]`. A disabled cache always returns an empty match at the root.
        """
        self.stats.queried_tokens += len(tokens)
        if not self.enabled:
            return MatchResult([], 0, self._root)
        node, pages = self._walk(tokens)
        self.stats.hit_tokens += len(pages) * self.page_size
        if self.listener is not None and pages:
            self.listener.hit(self._path_names(node), pages)
        return MatchResult(pages, len(pages) * self.page_size, node)

    def peek(self, tokens: Sequence[int]) -> MatchResult:
        """`match_prefix` without counting it as a query or a hit (the tiers looking below what is cached)."""
        if not self.enabled:
            return MatchResult([], 0, self._root)
        node, pages = self._walk(tokens)
        return MatchResult(pages, len(pages) * self.page_size, node)

    def _path_names(self, node: Node) -> list[int]:
        names: list[list[int]] = []
        while node is not self._root:
            names.append(node.names)
            node = node.up
        return [n for part in reversed(names) for n in part]

    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction (one reference each)."""
        self._check_attached(node)
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._protected += len(node.pages)
            node.lock_ref += 1
            node = node.up

    def unlock(self, node: Node) -> None:
        """Drop one reference taken by `lock`; ValueError if `node` holds none."""
        if node is not self._root and node.lock_ref <= 0:
            raise ValueError("unlock of a node that is not locked")
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
                self._evictable += len(node.pages)
            node = node.up

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache `pages` as holding `tokens`; return the caller's pages that are now redundant.

        `len(tokens)` must equal `len(pages) * page_size`. Where a leading part of `tokens`
        is already cached, the tree keeps its own pages; every `pages[i]` in that part that
        differs from the tree's page is returned, and the caller must free exactly those
        (pages it got from `match_prefix` are the tree's and are never returned). All other
        pages now belong to the tree. A disabled cache takes nothing and returns all pages.
        """
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages of {self.page_size}")
        if not self.enabled:
            return list(pages)
        node, cached = self._walk(tokens)
        redundant = [mine for mine, tree in zip(pages, cached, strict=False) if mine != tree]
        if len(cached) < len(pages):
            self._add_leaf(node, tokens[len(cached) * self.page_size :], pages[len(cached) :])
        return redundant

    def evict(self, num_pages: int) -> int:
        """Free unlocked leaves, least recently used first, until at least `num_pages` pages
        are freed or nothing is evictable. Whole nodes are freed, so the result may exceed
        `num_pages`. Returns the number of pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.up
            freed += self._remove_leaf(leaf)
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def total_refs(self) -> int:
        """Sum of lock counts over all nodes; 0 when no request holds a lock."""
        return sum(n.lock_ref for n in self._nodes())

    def reset(self) -> None:
        """Free every page held by the tree. ValueError if any node is locked."""
        if self._protected or self.total_refs():
            raise ValueError("reset while requests hold locks on the prefix cache")
        self.allocator.free([p for n in self._nodes() for p in n.pages])
        for node in self._nodes():
            node.parent = None
        self._root = Node((), [], None)
        self._evictable = 0
        self._record("cleared", [])

    def _walk(self, tokens: Sequence[int]) -> tuple[Node, list[int]]:
        """Follow whole pages of `tokens` down the tree, splitting the last node reached if
        the match ends inside it. Returns the deepest matched node and the matched pages."""
        ps = self.page_size
        self._clock += 1
        node, pages, pos = self._root, [], 0
        node.last_access = self._clock
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return node, pages

    def _common_pages(self, key: tuple[int, ...], tokens: Sequence[int], pos: int) -> int:
        """Number of leading whole pages of `key` equal to `tokens[pos:]` (at least 1: the
        first page is the child's dict key)."""
        ps = self.page_size
        if tuple(tokens[pos : pos + len(key)]) == key:
            return len(key) // ps
        n = 1
        while (n + 1) * ps <= len(key) and pos + (n + 1) * ps <= len(tokens):
            if tuple(tokens[pos + n * ps : pos + (n + 1) * ps]) != key[n * ps : (n + 1) * ps]:
                break
            n += 1
        return n

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node` after its first `n` pages; return the new upper part.

        `node` itself keeps the lower part so that references held by requests stay valid;
        the new parent inherits its lock count, since every lock on `node` passes through it.
        """
        ps = self.page_size
        upper = Node(node.key[: n * ps], node.pages[:n], node.up, node.names[:n])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.up.children[upper.key[:ps]] = upper
        node.key, node.pages, node.names, node.parent = node.key[n * ps :], node.pages[n:], node.names[n:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def _add_leaf(self, parent: Node, tokens: Sequence[int], pages: Sequence[int]) -> None:
        names = (
            page_hashes(tokens, self.page_size, parent.names[-1] if parent.names else ROOT, self.names_key)
            if self.names_pages
            else []
        )
        leaf = Node(tuple(tokens), list(pages), parent, names)
        leaf.last_access = self._clock
        parent.children[leaf.key[: self.page_size]] = leaf
        self._evictable += len(leaf.pages)
        self._record("stored", names)
        if self.listener is not None:
            self.listener.stored(names, leaf.pages)

    def _remove_leaf(self, leaf: Node) -> int:
        del leaf.up.children[leaf.key[: self.page_size]]
        leaf.parent = None
        if self.listener is not None:
            self.listener.evicted(leaf.names, leaf.pages)
        self.allocator.free(leaf.pages)
        self._evictable -= len(leaf.pages)
        self._record("removed", leaf.names)
        return len(leaf.pages)

    def _record(self, kind: str, names: list[int]) -> None:
        if self.record_events:
            self._events.append((kind, list(names)))

    def page_names(self) -> set[int]:
        """The names of every page the tree holds."""
        return {name for node in self._nodes() for name in node.names}

    def _is_evictable_leaf(self, node: Node) -> bool:
        return node is not self._root and not node.children and node.lock_ref == 0

    def _check_attached(self, node: Node) -> None:
        n = node
        while n.parent is not None:
            n = n.parent
        if n is not self._root:
            raise ValueError("lock of a node that is no longer in the tree (evicted?)")

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
