"""KV events: the router's index of a worker's prefix cache equals the worker's radix tree after random inserts,
evictions and flushes, a dropped event, a router restart and a worker restart; what it scores for a prompt is
what the tree would match; workers that stop answering or name pages another way are flagged."""

from __future__ import annotations

import collections
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from disagg_worker import keys
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.kv_events import HASH_SCHEME, RING, EventLog, page_hashes
from disagg_worker.mem.radix import RadixCache
from disagg_worker.router.kv_index import InstanceIndex, KVIndex

PAGE = 2
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=12)  # few symbols: prompts share prefixes


GROUP = st.integers(0, 1)


class IndexMachine(RuleBasedStateMachine):
    """A worker of two attention groups (each a radix tree, both reporting to one EventLog in its HTTP process) and
    a router polling it, with losses."""

    def __init__(self):
        super().__init__()
        self.allocators = [PageAllocator(64), PageAllocator(64)]
        self.trees = [RadixCache(PAGE, a, record_events=True) for a in self.allocators]
        self.log = EventLog(PAGE, "m")
        self.index = InstanceIndex()
        self.drop_next = False

    def publish(self, group: int) -> None:
        """A scheduler's report reaches the HTTP process."""
        self.log.apply(group, self.trees[group].take_events())

    def holders(self) -> dict[int, int]:
        """Each page name -> how many groups hold it."""
        return dict(collections.Counter(n for t in self.trees for n in t.page_names()))

    def poll(self) -> None:
        payload = self.log.since(self.index.epoch, self.index.seq)
        if self.drop_next and payload.get("events"):
            payload["events"].pop(random.Random(len(payload["events"])).randrange(len(payload["events"])))
            self.drop_next = False
        self.index.apply(payload, now=0.0)

    @rule(group=GROUP, tokens=TOKENS)
    def insert(self, group, tokens):
        n, tree, allocator = len(tokens) // PAGE, self.trees[group], self.allocators[group]
        if n == 0 or allocator.num_free < n:
            return
        cached = tree.match_prefix(tokens[: n * PAGE])
        pages = cached.pages + allocator.alloc(n - len(cached.pages))
        allocator.free(tree.insert(tokens[: n * PAGE], pages))
        self.publish(group)

    @rule(group=GROUP, n=st.integers(1, 8))
    def evict(self, group, n):
        self.trees[group].evict(n)
        self.publish(group)

    @rule(group=GROUP)
    def flush(self, group):
        self.trees[group].reset()
        self.publish(group)

    @rule()
    def router_polls(self):
        self.poll()

    @rule()
    def an_event_is_lost_on_the_way(self):
        self.drop_next = True

    @rule()
    def router_restarts(self):
        self.index = InstanceIndex()

    @rule()
    def worker_http_process_restarts(self):
        """A new process: a new epoch, its state rebuilt from the trees (as a fresh cache would start empty)."""
        self.log = EventLog(PAGE, "m")
        for g, tree in enumerate(self.trees):
            self.log.apply(g, [("stored", sorted(tree.page_names()))])

    @invariant()
    def index_converges_within_three_polls(self):
        """One answer may lose an event (its next answer carries the rest, or shows the gap), a gap or a cleared
        group is repaired by the answer after, a snapshot."""
        for _ in range(3):
            self.poll()
        assert dict(self.index.names) == self.holders()
        assert set(self.index.names) == self.log.names()
        for g, tree in enumerate(self.trees):
            assert self.index.groups.get(g, set()) == tree.page_names()

    @rule(tokens=TOKENS)
    def scores_what_each_group_matches(self, tokens):
        """A group's score is exactly what its tree matches; the worker's is its best group's."""
        for _ in range(3):
            self.poll()
        names = page_hashes(tokens, PAGE)
        want = [len(tree.match_prefix(tokens).pages) for tree in self.trees]
        assert [self.index.cached_pages(names, g) for g in range(len(self.trees))] == want
        assert self.index.cached_pages(names) == max(want)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


def test_a_page_is_named_by_its_whole_prefix():
    a, b = page_hashes([1, 2, 3, 4], 2), page_hashes([9, 9, 3, 4], 2)
    assert len(a) == 2 and a[1] != b[1]  # same tokens, different prefix
    assert page_hashes([1, 2, 3], 2) == a[:1]  # a partial page has no name
    assert page_hashes([3, 4], 2, parent=a[0]) == a[1:]


def test_a_router_that_fell_behind_the_ring_gets_a_snapshot():
    log = EventLog(PAGE, "m")
    index = InstanceIndex()
    index.apply(log.since("", -1), now=0.0)
    for i in range(RING + 5):
        log.apply(0, [("stored", [i])] if i % 2 == 0 else [("removed", [i - 1])])
    payload = log.since(index.epoch, index.seq)
    assert "snapshot" in payload
    index.apply(payload, now=1.0)
    assert set(index.names) == log.names() and index.snapshots == 2


def test_workers_that_go_silent_or_name_pages_differently_are_flagged():
    index = KVIndex(stale_after_s=6.0)
    a, b, c = EventLog(16, "m"), EventLog(32, "m"), EventLog(16, "m")
    for url, log in (("a", a), ("b", b), ("c", c)):
        index.of(url).apply(log.since("", -1), now=100.0)
    assert index.status("a", 101.0) == ("ok", "")
    assert index.status("b", 101.0)[0] == "mismatch" and "page size 32" in index.status("b", 101.0)[1]
    assert index.status("c", 107.0)[0] == "silent" and not index.usable("c", 107.0)
    index.of("d").problem = "GET /kv_events answered 404"
    assert index.status("d", 101.0) == ("silent", "GET /kv_events answered 404")
    payload = {**c.since("", -1), "hash_scheme": "other"}
    index.of("c").apply(payload, now=108.0)
    assert index.status("c", 108.0)[0] == "mismatch" and HASH_SCHEME in index.status("c", 108.0)[1]


def test_with_the_models_secret_names_are_keyed_and_a_router_keyed_otherwise_is_told():
    key, key_id = keys.kv_names("s3cret")
    assert keys.kv_names("s3cret") == (key, key_id) and keys.kv_names("") == (b"", "")
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    plain, keyed = page_hashes(tokens, 4), page_hashes(tokens, 4, key=key)
    # Whoever reads the names without the key cannot compute them for a prompt they guess.
    assert not set(plain) & set(keyed) and not set(keyed) & set(page_hashes(tokens, 4, key=keys.kv_names("x")[0]))
    tree = RadixCache(4, PageAllocator(8), record_events=True, names_key=key)
    tree.insert(tokens, [1, 2])
    assert tree.page_names() == set(keyed) and tree.take_events() == [("stored", keyed)]

    router = KVIndex(key_id=key_id)
    for url, log in (("same", EventLog(4, "m", key_id=key_id)), ("plain", EventLog(4, "m"))):
        log.apply(0, [("stored", keyed)])
        router.of(url).apply(log.since("", -1), now=1.0)
    assert router.status("same", 2.0) == ("ok", "") and router.cached_pages("same", keyed, 2.0) == 2
    state, why = router.status("plain", 2.0)
    assert state == "mismatch" and "with the model's secret" in why and router.cached_pages("plain", keyed, 2.0) == 0
    assert router.reference() == (4, "m")
    unkeyed = KVIndex()
    unkeyed.of("same").apply(EventLog(4, "m", key_id=key_id).since("", -1), now=1.0)
    assert unkeyed.status("same", 2.0)[0] == "mismatch" and unkeyed.reference() is None
