"""KV events: the router's index of a worker's prefix cache equals the worker's radix tree after random inserts,
evictions and flushes, a dropped event, a router restart and a worker restart; what it scores for a prompt is
what the tree would match; workers that stop answering or name pages another way are flagged."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.kv_events import HASH_SCHEME, RING, EventLog, page_hashes
from disagg_worker.mem.radix import RadixCache
from disagg_worker.router.kv_index import InstanceIndex, KVIndex

PAGE = 2
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=12)  # few symbols: prompts share prefixes


class IndexMachine(RuleBasedStateMachine):
    """A worker (radix tree -> its HTTP process's EventLog) and a router polling it, with losses."""

    def __init__(self):
        super().__init__()
        self.allocator = PageAllocator(64)
        self.tree = RadixCache(PAGE, self.allocator, record_events=True)
        self.log = EventLog(PAGE, "m")
        self.index = InstanceIndex()
        self.drop_next = False

    def publish(self) -> None:
        """The scheduler's report reaches the HTTP process."""
        self.log.apply(0, self.tree.take_events())

    def poll(self) -> None:
        payload = self.log.since(self.index.epoch, self.index.seq)
        if self.drop_next and payload.get("events"):
            payload["events"].pop(random.Random(len(payload["events"])).randrange(len(payload["events"])))
            self.drop_next = False
        self.index.apply(payload, now=0.0)

    @rule(tokens=TOKENS)
    def insert(self, tokens):
        n = len(tokens) // PAGE
        if n == 0 or self.allocator.num_free < n:
            return
        cached = self.tree.match_prefix(tokens[: n * PAGE])
        pages = cached.pages + self.allocator.alloc(n - len(cached.pages))
        self.allocator.free(self.tree.insert(tokens[: n * PAGE], pages))
        self.publish()

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        self.tree.evict(n)
        self.publish()

    @rule()
    def flush(self):
        self.tree.reset()
        self.publish()

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
        """A new process: a new epoch, its state rebuilt from the tree (as a fresh cache would start empty)."""
        self.log = EventLog(PAGE, "m")
        self.log.apply(0, [("stored", sorted(self.tree.page_names()))])

    @invariant()
    def index_converges_within_two_polls(self):
        self.poll()  # a gap found here is repaired by the next answer, a snapshot
        self.poll()
        assert self.index.names == self.tree.page_names() == self.log.names()

    @rule(tokens=TOKENS)
    def scores_what_the_tree_matches(self, tokens):
        self.poll()
        self.poll()
        want = len(self.tree.match_prefix(tokens).pages)
        assert self.index.cached_pages(page_hashes(tokens, PAGE)) == want


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
    assert index.names == log.names() and index.snapshots == 2


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
