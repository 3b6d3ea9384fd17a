"""RadixCache: prefix reuse, redundant pages, LRU eviction that respects locks."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.radix import RadixCache

PS = 2


def _cache(num_pages=32, page_size=PS, enabled=True):
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc, enabled=enabled), alloc


def _cache_seq(cache, alloc, tokens):
    """What a finished request does: reuse the cached prefix, fill the rest, insert, free."""
    m = cache.match_prefix(tokens)
    cache.lock(m.node)
    new = alloc.alloc(len(tokens) // cache.page_size - len(m.pages))
    redundant = cache.insert(tokens, m.pages + new)
    alloc.free(redundant)
    cache.unlock(m.node)
    return m.pages + new


# Tokens whose length is a whole number of pages, from a tiny alphabet so prefixes collide.
token_seqs = st.integers(min_value=1, max_value=5).flatmap(
    lambda n: st.lists(st.integers(0, 1), min_size=n * PS, max_size=n * PS)
)


class RadixMachine(RuleBasedStateMachine):
    """Model: dict from a whole-page token prefix to the page id holding its last page."""

    def __init__(self):
        super().__init__()
        self.num_pages = 24
        self.cache, self.alloc = _cache(self.num_pages)
        self.model: dict[tuple, int] = {}
        self.locks: list[tuple] = []  # (node, pages the lock protects)

    def _expected_match(self, tokens):
        pages = []
        while len(pages) * PS + PS <= len(tokens):
            key = tuple(tokens[: (len(pages) + 1) * PS])
            if key not in self.model:
                break
            pages.append(self.model[key])
        return pages

    @rule(tokens=token_seqs)
    def match_is_longest_cached_prefix(self, tokens):
        m = self.cache.match_prefix(tokens + [7])  # a trailing partial page is never matched
        assert m.pages == self._expected_match(tokens)
        assert m.num_tokens == len(m.pages) * PS

    @rule(tokens=token_seqs, reuse=st.booleans())
    def insert(self, tokens, reuse):
        """A request caches its pages; with reuse=False it recomputed the prefix itself."""
        m = self.cache.match_prefix(tokens) if reuse else self.cache.match_prefix([])
        self.cache.lock(m.node)
        need = len(tokens) // PS - len(m.pages)
        if self.alloc.num_free < need:
            self._sync_evict(need - self.alloc.num_free)
        new = self.alloc.alloc(need)
        if new is not None:
            pages = m.pages + new
            expected = self._expected_redundant(tokens, pages)
            redundant = self.cache.insert(tokens, pages)
            assert redundant == expected
            self.alloc.free(redundant)
        self.cache.unlock(m.node)

    def _expected_redundant(self, tokens, pages):
        redundant = []
        for k, page in enumerate(pages, start=1):
            key = tuple(tokens[: k * PS])
            if key in self.model:
                if self.model[key] != page:
                    redundant.append(page)
            else:
                self.model[key] = page
        return redundant

    @rule(tokens=token_seqs)
    def lock(self, tokens):
        m = self.cache.match_prefix(tokens)
        self.cache.lock(m.node)
        self.locks.append((m.node, m.pages))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(min_value=0))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(min_value=0, max_value=30))
    def evict(self, n):
        self._sync_evict(n)

    def _sync_evict(self, n):
        evictable, free_before = self.cache.evictable_pages, self.alloc.num_free
        freed = self.cache.evict(n)
        assert self.alloc.num_free == free_before + freed
        assert freed >= n if evictable >= n else freed == evictable
        self.model = {k: p for k, p in self.model.items() if not self.alloc.is_free(p)}
        for _, pages in self.locks:
            assert not any(self.alloc.is_free(p) for p in pages), "a locked page was evicted"

    @rule()
    def every_cached_prefix_matches_in_full(self):
        # Eviction only removes leaves, so what remains is still closed under prefixes.
        for key in self.model:
            assert self.cache.match_prefix(list(key)).pages == self._expected_match(list(key))

    @invariant()
    def pages_are_in_tree_xor_free(self):
        assert not any(self.alloc.is_free(p) for p in self.model.values())
        assert len(set(self.model.values())) == len(self.model)
        assert self.cache.total_pages == len(self.model)
        assert self.alloc.num_free + self.cache.total_pages == self.num_pages
        locked = {p for _, pages in self.locks for p in pages}
        assert self.cache.protected_pages >= len(locked)
        assert self.cache.evictable_pages + self.cache.protected_pages == self.cache.total_pages

    def teardown(self):
        for node, _ in self.locks:
            self.cache.unlock(node)
        self.cache.evict(10**9)
        assert self.alloc.num_free == self.num_pages
        assert self.cache.total_refs() == 0
        assert self.cache.total_pages == 0


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_reuses_cached_prefix_pages():
    cache, alloc = _cache()
    pages = _cache_seq(cache, alloc, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 9, 9, 9])
    assert m.pages == pages[:2] and m.num_tokens == 4
    assert cache.stats.hit_tokens == 4 and cache.stats.queried_tokens == 6 + 7


def test_partial_page_is_never_matched():
    cache, alloc = _cache()
    _cache_seq(cache, alloc, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3]).pages == cache.match_prefix([1, 2]).pages
    assert len(cache.match_prefix([1, 2, 3]).pages) == 1


def test_same_content_with_other_pages_returns_them_as_redundant():
    cache, alloc = _cache()
    first = _cache_seq(cache, alloc, [1, 2, 3, 4])
    second = alloc.alloc(3)
    redundant = cache.insert([1, 2, 3, 4, 5, 6], second)
    assert redundant == second[:2]
    alloc.free(redundant)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == first + second[2:]
    assert alloc.num_used == cache.total_pages == 3


def test_reinserting_cached_prefix_adds_nothing():
    cache, alloc = _cache()
    pages = _cache_seq(cache, alloc, [1, 2, 3, 4])
    assert cache.insert([1, 2], pages[:1]) == []
    assert cache.total_pages == 2


def test_divergence_inside_a_node_splits_at_page_boundary():
    cache, alloc = _cache()
    a = _cache_seq(cache, alloc, [1, 1, 2, 2, 3, 3])
    b = _cache_seq(cache, alloc, [1, 1, 2, 2, 4, 4])
    assert b[:2] == a[:2] and b[2] != a[2]
    assert cache.total_pages == 4
    # The shared part survives eviction of one branch; the other branch is intact.
    cache.evict(1)
    assert cache.total_pages == 3
    left = [cache.match_prefix(t).pages for t in ([1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 4, 4])]
    assert sorted(map(len, left)) == [2, 3]


def test_eviction_is_lru_and_skips_locked_branch():
    cache, alloc = _cache()
    a = _cache_seq(cache, alloc, [0, 0, 1, 1])
    b = _cache_seq(cache, alloc, [0, 0, 2, 2])
    c = _cache_seq(cache, alloc, [5, 5])
    cache.match_prefix([0, 0, 1, 1])  # a is now the most recently used
    locked = cache.match_prefix([5, 5])
    cache.lock(locked.node)  # c is the least recently used but locked
    assert cache.evict(1) == 1
    assert alloc.is_free(b[1]) and not alloc.is_free(a[1]) and not alloc.is_free(c[0])
    # Everything unlocked goes, parents included once their last child is gone.
    assert cache.evict(100) == 2
    assert cache.total_pages == cache.protected_pages == 1
    cache.unlock(locked.node)
    assert cache.evict(100) == 1 and alloc.num_free == alloc.num_total


def test_lock_on_child_protects_ancestors():
    cache, alloc = _cache()
    pages = _cache_seq(cache, alloc, [1, 1, 2, 2, 3, 3])
    _cache_seq(cache, alloc, [1, 1, 2, 2, 4, 4])  # splits after page 2
    m = cache.match_prefix([1, 1, 2, 2, 3, 3])
    cache.lock(m.node)
    assert cache.protected_pages == 3
    cache.evict(100)
    assert cache.match_prefix([1, 1, 2, 2, 3, 3]).pages == pages
    assert cache.total_pages == 3
    cache.unlock(m.node)
    assert cache.total_refs() == 0


def test_unlock_below_zero_raises():
    cache, alloc = _cache()
    _cache_seq(cache, alloc, [1, 2])
    m = cache.match_prefix([1, 2])
    with pytest.raises(ValueError):
        cache.unlock(m.node)


def test_lock_of_evicted_node_raises():
    cache, alloc = _cache()
    _cache_seq(cache, alloc, [1, 2])
    m = cache.match_prefix([1, 2])
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.lock(m.node)


def test_insert_rejects_partial_pages():
    cache, alloc = _cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc.alloc(2))


def test_disabled_cache_matches_nothing_and_returns_all_pages():
    cache, alloc = _cache(enabled=False)
    pages = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4], pages) == pages
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.pages == [] and m.num_tokens == 0 and m.node is cache.root
    assert cache.total_pages == 0


def test_reset_frees_everything_but_refuses_while_locked():
    cache, alloc = _cache()
    _cache_seq(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    with pytest.raises(ValueError):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert alloc.num_free == alloc.num_total and cache.total_pages == 0
    assert cache.match_prefix([1, 2, 3, 4]).pages == []
