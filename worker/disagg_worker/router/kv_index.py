"""The router's exact index of its workers' prefix caches, fed by each worker's GET /kv_events.

Per worker the router keeps the page names (mem/kv_events.py) the worker holds, with the epoch and sequence
number of the last event applied. Each health round asks every worker for what followed (`query`); the answer
is events, applied in order, or a snapshot that replaces the set (after a gap, a restart of either side, or the
first time). An event out of sequence drops the position, so the next round gets a snapshot: the index
converges after any loss.

Under DP attention each group of a worker has its own cache, indexed on its own: a worker is scored by the
group that holds most of a prompt, and the request runs on a group chosen the same way (`policies/groups.py`).

A worker is scored only while its index is good (`usable`): it answered within `stale_after_s` (one that stops
publishing is "silent", and the router falls back to load for it), and it names pages the router's way (same
hash scheme and key, and the same page size and model as the workers already indexed: "mismatch" otherwise).
Both show in the router's /health.

Below a worker's cache are its host memory and the model's Mooncake Store (`engine/tiers.py`): the index keeps the
names each worker has in host memory and the names any worker wrote to the store, so that a prompt is scored by its
run of pages in the cache, then in host memory, then in the store (`tiers`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from disagg_worker.mem.kv_events import HASH_SCHEME


@dataclass
class InstanceIndex:
    epoch: str = ""
    seq: int = -1
    # Name -> how many of the worker's attention groups hold it (1 without DP attention)...
    names: collections.Counter[int] = field(default_factory=collections.Counter)
    # ...and each group's names (group 0 alone without DP attention).
    groups: dict[int, set[int]] = field(default_factory=dict)
    page_size: int = 0
    model: str = ""
    hash_scheme: str = ""
    key_id: str = ""
    updated: float | None = None  # monotonic time of the last answer applied
    snapshots: int = 0
    events: int = 0
    problem: str = ""  # why the worker's answers cannot be used ("" while they can)
    host: set[int] = field(default_factory=set)  # pages in the worker's host memory
    store: set[int] = field(default_factory=set)  # pages the worker wrote to the store

    def query(self) -> dict[str, str]:
        return {"epoch": self.epoch, "since": str(self.seq)}

    def apply(self, payload: dict, now: float) -> None:
        """One /kv_events answer."""
        self.epoch, self.page_size = str(payload.get("epoch", "")), int(payload.get("page_size", 0))
        self.model, self.hash_scheme = str(payload.get("model", "")), str(payload.get("hash_scheme", ""))
        self.key_id = str(payload.get("key_id", ""))
        if "snapshot" in payload:
            self.groups = {int(g): {int(n, 16) for n in names} for g, names in payload["snapshot"].items()}
            self.names = collections.Counter(n for names in self.groups.values() for n in names)
            self.host = {int(n, 16) for n in payload.get("host", [])}
            self.store = {int(n, 16) for n in payload.get("store", [])}
            self.seq = int(payload["seq"])
            self.snapshots += 1
        else:
            for e in payload.get("events", []):
                # A gap: ask for a snapshot next time, without counting this answer as fresh.
                if int(e["seq"]) != self.seq + 1:
                    self.seq = -1
                    return
                self._apply(int(e.get("group", 0)), e["kind"], [int(n, 16) for n in e["pages"]])
                self.seq += 1
                self.events += 1
        self.updated = now

    def _apply(self, group: int, kind: str, pages: list[int]) -> None:
        if kind in ("host_stored", "host_removed", "store_stored"):
            tier = self.store if kind == "store_stored" else self.host
            (tier.difference_update if kind == "host_removed" else tier.update)(pages)
            return
        held = self.groups.setdefault(group, set())
        if kind == "cleared":
            kind, pages = "removed", list(held)
        if kind == "stored":
            self.names.update(n for n in pages if n not in held)
            held.update(pages)
        elif kind == "removed":
            gone = [n for n in pages if n in held]
            held.difference_update(gone)
            self.names.subtract(gone)
            for n in gone:
                if self.names[n] <= 0:
                    del self.names[n]

    def cached_pages(self, names: Sequence[int], group: int | None = None) -> int:
        """How many leading pages of a prompt (its page names, in order) the worker holds: in `group`, or in the
        group that holds most (a group holding a page holds the pages before it, so that is the run of names any
        group holds)."""
        held: collections.Counter[int] | set[int] = self.names if group is None else self.groups.get(group, set())
        return run_in(names, held)


def run_in(names: Sequence[int], held: collections.Counter[int] | set[int]) -> int:
    """How many of `names`, from the first, are in `held`."""
    n = 0
    for name in names:
        if name not in held:
            break
        n += 1
    return n


@dataclass
class KVIndex:
    stale_after_s: float = 6.0
    key_id: str = ""  # the id of the key the router names pages with (keys.kv_names; "" unkeyed)
    instances: dict[str, InstanceIndex] = field(default_factory=dict)

    def of(self, url: str) -> InstanceIndex:
        return self.instances.setdefault(url, InstanceIndex())

    def known(self, url: str) -> InstanceIndex:
        """The worker's index as it stands (an empty one, not kept, before its first answer)."""
        return self.instances.get(url) or InstanceIndex()

    def forget(self, keep: set[str]) -> None:
        """Drop the workers no longer in the pool."""
        for url in set(self.instances) - keep:
            del self.instances[url]

    def reference(self) -> tuple[int, str] | None:
        """(page size, model) of the first worker indexed with the router's hash scheme and key: the others must
        agree."""
        for _, i in sorted(list(self.instances.items())):  # a copy: a request's thread reads while the loop prunes
            if i.hash_scheme == HASH_SCHEME and i.key_id == self.key_id and i.page_size:
                return i.page_size, i.model
        return None

    def status(self, url: str, now: float) -> tuple[str, str]:
        """("ok" | "silent" | "mismatch" | "unknown", why)."""
        i = self.instances.get(url)
        if i is None or i.updated is None:
            return ("silent", i.problem or "no KV events received") if i is not None else ("unknown", "")
        if i.hash_scheme != HASH_SCHEME:
            return "mismatch", f"hash scheme {i.hash_scheme or 'none'}, the router's is {HASH_SCHEME}"
        if i.key_id != self.key_id:
            mine = "with the model's secret" if self.key_id else "unkeyed (no --auth-token-file)"
            return "mismatch", f"pages named with another key than the router's, which names them {mine}"
        ref = self.reference()
        if ref is not None and (i.page_size, i.model) != ref:
            return "mismatch", f"page size {i.page_size} of model {i.model!r}; others: {ref[0]} of {ref[1]!r}"
        if now - i.updated > self.stale_after_s:
            return "silent", i.problem or f"no answer for {now - i.updated:.0f} s"
        return "ok", ""

    def usable(self, url: str, now: float) -> bool:
        return self.status(url, now)[0] == "ok"

    def cached_pages(self, url: str, names: Sequence[int], now: float, group: int | None = None) -> int:
        """Leading pages of a prompt the worker holds (in `group`, or in its best group); 0 while its index is not
        usable (scored by load alone)."""
        i = self.instances.get(url)
        return i.cached_pages(names, group) if i is not None and self.usable(url, now) else 0

    def tiers(self, url: str, names: Sequence[int], start: int, now: float) -> tuple[int, int]:
        """Past the prompt's first `start` pages (the worker's cache), its run of pages in the worker's host memory,
        then in the store (written by any worker); (0, 0) while the worker's index is not usable."""
        i = self.instances.get(url)
        if i is None or not self.usable(url, now):
            return 0, 0
        host = run_in(names[start:], i.host)
        stores = [j.store for u, j in list(self.instances.items()) if j.store and self.usable(u, now)]
        store = run_in(names[start + host :], set().union(*stores)) if stores else 0
        return host, store

    def describe(self, url: str, now: float) -> dict:
        i = self.known(url)
        state, why = self.status(url, now)
        d = {"state": state, "pages": len(i.names), "seq": i.seq, "snapshots": i.snapshots}
        return {**d, "why": why} if why else d
