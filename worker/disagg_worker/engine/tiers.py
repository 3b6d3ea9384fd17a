"""The KV tiers under the prefix cache: host memory (L2, `mem/host_tier.py`) and Mooncake Store (L3, `mem/store.py`).

The radix cache tells the tiers (its `listener`) of every page it takes, hits and evicts, under the page's name:
- write_through: a page goes down when the cache takes it; write_through_selective: when it is hit again;
  write_back: when it is evicted. Whatever the policy, an evicted page that was written down is not lost.
- The host tier writes to the store what it writes (write_through, write_through_selective) or what it evicts
  (write_back). Writes to the store run on the store thread, never the scheduler's.
- A request that arrives is looked up below the cache (`prefetch`): the pages the store holds past those the
  cache and host memory hold are read into host memory on the store thread. Its admission waits per the prefetch
  policy (`ready`): best_effort not at all, wait_complete until the read ends, timeout at most that long.
- Admitting a request (`restore`): the pages host memory holds past the cache's are copied into free pool pages
  and put in the tree, so that the cache's match finds them. On the CPU this is a copy by the scheduler's thread;
  with the overlap schedule it runs while the batch before computes. On a GPU it is an asynchronous copy from
  pinned memory on the forward's stream, ordered before the forward that reads it.

A slow or absent store costs only recompute: its calls run on the store thread, a read that takes longer than its
policy allows is abandoned (its pages, if they come, stay in host memory for the next request), and a failing
store is left alone for a while (`mem/store.py`). So does a page changed in the store: it fails its tag and is
dropped there, read as a miss (`mem/page_tag.py`).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from disagg_worker.config import EngineConfig
from disagg_worker.engine.drafting import ModelDrafter
from disagg_worker.engine.prefix_tiers import NoTiers
from disagg_worker.mem.host_tier import HostTier
from disagg_worker.mem.kv_events import ROOT, Event, page_hashes
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.mem.page_tag import PageSeal
from disagg_worker.mem.radix import RadixCache
from disagg_worker.mem.store import MooncakeStore
from disagg_worker.tier_config import TierConfig

log = logging.getLogger(__name__)

PUT_QUEUE_PAGES = 4096  # pages waiting to be written to the store beyond this are not written
PUT_BATCH = 16  # pages per write to the store
WAIT_COMPLETE_BOUND = 4  # wait_complete waits at most this many prefetch timeouts (then the store counts as slow)


PAGES = Counter(
    "disagg_kv_tier_pages",
    "KV pages moved between the tiers under the prefix cache: loaded_host (host memory into the pool), "
    "fetched_store (the store into host memory), written_store, dropped_store (not written: queue full or store "
    "down)",
    ["op"],
)
PREFETCH_ABANDONED = Counter(
    "disagg_kv_tier_prefetch_abandoned", "Requests admitted before their read from the store ended (its policy's bound)"
)


@dataclass
class TierStats:
    loaded_host: int = 0  # pages copied from host memory into the pool (a prefix hit below the cache)
    fetched_store: int = 0  # pages read from the store into host memory
    written_store: int = 0
    dropped_store: int = 0  # pages not written: the store's queue was full or the store down
    prefetch_abandoned: int = 0

    def add(self, op: str, pages: int) -> None:
        setattr(self, op, getattr(self, op) + pages)
        if op == "prefetch_abandoned":
            PREFETCH_ABANDONED.inc(pages)
        else:
            PAGES.labels(op).inc(pages)


@dataclass
class Prefetch:
    started: float
    covered: int = 0  # pages of the request the cache and host memory held, with those this read brought
    again: bool = False  # asked for again at admission (`_refetch`)
    done: bool = False


class KVTiers:
    def __init__(
        self,
        cfg: TierConfig,
        host: HostTier,
        radix: RadixCache,
        store: MooncakeStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.host = host
        self.radix = radix
        self.store = store
        self.clock = clock
        self.stats = TierStats()
        self.wake: Callable[[], None] = lambda: None
        self._prefetches: dict[str, Prefetch] = {}
        self._queued_puts = 0
        self._lock = threading.Lock()
        self._events: list[Event] = []  # what the tiers now hold, for the KV events (`mem/kv_events.py`)
        radix.listener = self
        host.on_evict = self._host_evicted
        host.evicted_bytes = store is not None and cfg.write_policy == "write_back"
        # Reads and writes on threads of their own: a request's read never waits behind the pages others write.
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._threads = []
        if store is not None:
            for name, jobs in (("kv-store-read", self._reads), ("kv-store-write", self._writes)):
                thread = threading.Thread(target=self._serve_store, args=(jobs,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    # ---- the radix cache's listener (scheduler thread) --------------------------------------------------
    def stored(self, names: list[int], pages: list[int]) -> None:
        if self.cfg.write_policy == "write_through":
            self._write_down(names, pages)

    def hit(self, names: list[int], pages: list[int]) -> None:
        if self.cfg.write_policy == "write_through_selective":
            self._write_down(names, pages)

    def evicted(self, names: list[int], pages: list[int]) -> None:
        if self.cfg.write_policy != "write_through_selective":  # selective: only what was hit goes down
            self._write_down(names, pages)

    def _write_down(self, names: list[int], pages: list[int]) -> None:
        """Save pages in host memory; write to the store what the policy writes through, and what host memory had
        no room for (a batch larger than it), which would be lost otherwise."""
        saved = self.host.save(names, pages)
        self._record("host_stored", saved)
        if self.store is None:
            return
        if self.cfg.write_policy != "write_back":
            self._enqueue_put(saved, [self.host.page_bytes(n) for n in saved])
        kept = set(saved)
        missed = [(n, p) for n, p in zip(names, pages, strict=True) if n not in kept and n not in self.host]
        if missed:
            self._enqueue_put([n for n, _ in missed], self.host.pool_bytes([p for _, p in missed]))

    # ---- admission (scheduler thread) -------------------------------------------------------------------
    def admit(self, rid: str, tokens: Sequence[int], take_pages: Callable[[int], list[int] | None]) -> bool:
        """Whether request `rid` may be admitted now (`ready`); if so, its pages in host memory are restored."""
        if not self.ready(rid) or self._refetch(rid, tokens):
            return False
        self.restore(tokens, take_pages)
        return True

    def restore(self, tokens: Sequence[int], take_pages: Callable[[int], list[int] | None]) -> int:
        """Load the pages host memory holds past the cache's match of `tokens` into the tree; the pages loaded."""
        ps = self.radix.page_size
        match = self.radix.peek(tokens)
        full = len(tokens) // ps
        if full <= len(match.pages):
            return 0
        parent = match.node.names[-1] if match.node.names else ROOT
        names = page_hashes(tokens[match.num_tokens : full * ps], ps, parent, self.radix.names_key)
        names = names[: self.host.run_of(names)]
        if not names:
            return 0
        self.host.pin(names)
        self.radix.lock(match.node)
        try:
            pages = take_pages(len(names))
            if pages is None:
                return 0
            self.host.load(names, pages)
            end = match.num_tokens + len(names) * ps
            redundant = self.radix.insert(tokens[:end], list(match.pages) + pages)
            self.radix.allocator.free(redundant)
        finally:
            self.radix.unlock(match.node)
            self.host.unpin(names)
        self.stats.add("loaded_host", len(names))
        return len(names)

    def prefetch(self, rid: str, tokens: Sequence[int]) -> None:
        """Start reading the pages of `tokens` the store holds past what the cache and host memory hold."""
        if self.store is None:
            return
        names = self._names(tokens)
        below = self._covered(tokens, names)
        if below >= len(names):
            with self._lock:  # nothing to read now; `admit` still sees whether host memory keeps them
                self._prefetches[rid] = Prefetch(self.clock(), covered=below, done=True)
            return
        self._get_later(rid, names, below, again=False)

    def _names(self, tokens: Sequence[int]) -> list[int]:
        ps = self.radix.page_size
        return page_hashes(tokens[: len(tokens) // ps * ps], ps, ROOT, self.radix.names_key)

    def _covered(self, tokens: Sequence[int], names: list[int]) -> int:
        """Pages of `tokens`, from the first, that the cache and then host memory hold."""
        below = len(self.radix.peek(tokens).pages)
        return below + self.host.run_of(names[below:])

    def _get_later(self, rid: str, names: list[int], below: int, again: bool) -> None:
        job = Prefetch(self.clock(), covered=below, again=again)
        with self._lock:
            self._prefetches[rid] = job
        self._reads.put(("get", names[below:], job))
        if self.cfg.prefetch_policy == "timeout":
            timer = threading.Timer(self.cfg.prefetch_timeout, self.wake)
            timer.daemon = True
            timer.start()

    def _refetch(self, rid: str, tokens: Sequence[int]) -> bool:
        """Whether `rid` waits for a second read: host memory dropped pages it held when `rid` arrived (other
        requests' pages took their slots while it waited), which the store may hold. Once per request."""
        with self._lock:
            job = self._prefetches.get(rid)
        if job is None or job.again:
            return False
        names = self._names(tokens)
        below = self._covered(tokens, names)
        if below >= job.covered:
            return False
        self._get_later(rid, names, below, again=True)
        return self.cfg.prefetch_policy != "best_effort"

    def ready(self, rid: str) -> bool:
        """Whether request `rid` may be admitted: its prefetch, if any, has gone as far as the policy waits."""
        with self._lock:
            job = self._prefetches.get(rid)
        if job is None or job.done or self.cfg.prefetch_policy == "best_effort":
            return True
        bound = self.cfg.prefetch_timeout
        if self.cfg.prefetch_policy == "wait_complete":
            bound *= WAIT_COMPLETE_BOUND
        if self.clock() - job.started < bound:
            return False
        self.stats.add("prefetch_abandoned", 1)
        self.forget(rid)
        return True

    def forget(self, rid: str) -> None:
        with self._lock:
            self._prefetches.pop(rid, None)

    @property
    def prefetching(self) -> bool:
        with self._lock:
            return any(not j.done for j in self._prefetches.values())

    # ---- the store threads ----------------------------------------------------------------------------
    def _host_evicted(self, names: list[int], data: list[bytes]) -> None:
        self._record("host_removed", names)
        if data:  # write_back to a store
            self._enqueue_put(names, data)

    def _record(self, kind: str, names: list[int]) -> None:
        if names:
            with self._lock:
                self._events.append((kind, list(names)))

    def take_events(self) -> list[Event]:
        """The tiers' events since the last call (any thread's)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _enqueue_put(self, names: list[int], data: list[bytes]) -> None:
        if not names:
            return
        with self._lock:
            if self._queued_puts + len(names) > PUT_QUEUE_PAGES:
                self.stats.add("dropped_store", len(names))
                return
            self._queued_puts += len(names)
        for start in range(0, len(names), PUT_BATCH):  # a read waits for at most one batch in the client
            self._writes.put(("put", names[start : start + PUT_BATCH], data[start : start + PUT_BATCH]))

    def _serve_store(self, jobs: queue.Queue) -> None:
        assert self.store is not None
        while True:
            kind, names, arg = jobs.get()
            if kind == "stop":
                jobs.task_done()
                return
            try:
                if kind == "put":
                    self._put(names, arg)
                else:
                    self._get(names, arg)
            except Exception:  # noqa: BLE001 - the store failing costs recompute, never the instance
                log.exception("KV store: %s of %d pages failed", kind, len(names))
            finally:
                if kind == "get":
                    arg.done = True
                    self.wake()
                jobs.task_done()

    def settle(self) -> None:
        """Wait until the store threads have done every read and write asked of them so far."""
        self._reads.join()
        self._writes.join()

    def _put(self, names: list[int], data: list[bytes]) -> None:
        assert self.store is not None
        with self._lock:
            self._queued_puts -= len(names)
        if self.store.put(names, data):
            self.stats.add("written_store", len(names))
            self._record("store_stored", names)
        else:
            self.stats.add("dropped_store", len(names))

    def _get(self, names: list[int], job: Prefetch) -> None:
        assert self.store is not None
        found = self.store.exists(names)
        values = self.store.get(names[:found]) if found else []
        if values:
            taken = self.host.put_bytes(names[: len(values)], values)
            self.stats.add("fetched_store", taken)
            job.covered += taken  # host memory now holds these too: `_refetch` reads them again if they go

    def close(self, close_store: bool = True) -> None:
        """Stop the store thread (after what it was asked) and, unless told not to, the store's client."""
        if self.store is not None:
            for jobs in (self._reads, self._writes):
                jobs.put(("stop", [], None))
            for thread in self._threads:
                thread.join(timeout=5)
            if close_store:
                self.store.close()


def build_tiers(
    cfg: EngineConfig, pool: KVPool, drafter: ModelDrafter | None, radix: RadixCache, model_id: str
) -> KVTiers | NoTiers:
    """The tiers under `radix` for an instance whose KV is in `pool` (and a draft's own pool, if it has one), or
    none (`NoTiers`) when `--enable-hierarchical-cache` is off. The store's keys start with the model's id, its
    KV layout and the key of its page names, so that no other model's pages are ever read as its own."""
    tiers = cfg.cache.tiers
    if not tiers.enabled:
        return NoTiers()
    pools = [pool, drafter.kv] if drafter is not None and isinstance(drafter.kv, KVPool) else [pool]
    buffers = [b for p in pools for b in p.buffers()]
    page_nbytes = sum(b[0].numel() * b.element_size() for b in buffers)
    host = HostTier(buffers, tiers.host_pages(cfg.cache.total_pages, page_nbytes))
    layout = ";".join(f"{b.dtype}{tuple(b.shape[1:])}" for b in buffers)
    digest = hashlib.blake2b(f"{model_id}|{layout}".encode(), digest_size=8).hexdigest()
    store = None
    if tiers.store:
        prefix = f"disagg/{digest}/{cfg.disagg.kv_names[1] or 'unkeyed'}"
        seal = PageSeal(cfg.disagg.store_tag_key, page_nbytes)
        store = MooncakeStore(tiers.store_master, tiers.metadata_server, cfg.disagg.advertise_host, prefix, seal)
    log.info(
        "KV tiers: %d pages (%.1f MB) of host memory, %s; store %s",
        host.slots,
        host.slots * page_nbytes / 1e6,
        tiers.write_policy,
        tiers.store_master or "none",
    )
    return KVTiers(tiers, host, radix, store)
