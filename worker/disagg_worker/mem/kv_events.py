"""KV events: what an instance's prefix cache stores and evicts, named so that a router can index it exactly.

A cached page is named by a chained hash over the token ids of every page up to and including it
(`page_hashes`): equal names mean equal prefixes, so the longest cached prefix of a prompt is the longest run of
its page names an instance holds. With the model's shared secret the hash is keyed (`keys.kv_names`): only the
router and the workers can name a prompt's pages, so the names a reader sees say nothing about which prompts
were served. The radix cache (`radix.py`) records one event per change:

- `("stored", [name, ...])`: pages now held, a prefix's pages in order (their parents are held);
- `("removed", [name, ...])`: pages evicted;
- `("cleared", [])`: everything dropped (a cache flush).

The tiers under the cache (`engine/tiers.py`) add theirs: `("host_stored" | "host_removed", [name, ...])` for the
instance's host memory, and `("store_stored", [name, ...])` for the pages it wrote to Mooncake Store, which every
instance of the model reads (the store evicts without telling: a router's view of it only ever over-counts, which
costs a miss, never a wrong answer).

The HTTP process applies them to an `EventLog` per instance: the set of names held now, a sequence number per
event and the latest `RING` events. A router asks for what follows the last sequence number it saw
(`EventLog.since`) and gets the events, or a snapshot of the whole set when it missed some (a gap, its own
restart, or the instance's: the `epoch` changes with every process), so its index converges after any loss.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import secrets
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Name of the hash below and of the answers' layout (v2: snapshots by attention group, names keyed with the model's
# secret), sent with every payload: instances that name pages differently cannot be mixed.
HASH_SCHEME = "blake2b64-chain-v2"
ROOT = 0  # the name "before" a prompt's first page
RING = 4096  # events an EventLog keeps for routers that fell behind...
RING_NAMES = 1 << 18  # ...and at most this many page names in them (a long prompt's event holds thousands)
STORE_NAMES = 1 << 18  # the names an EventLog remembers having written to the store (the oldest forgotten first)

Event = tuple[str, list[int]]


def page_hash(parent: int, tokens: Sequence[int], key: bytes = b"") -> int:
    """The name of a page holding `tokens` after the prefix named `parent` (keyed with `key`, if any)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8, key=key)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT, key: bytes = b"") -> list[int]:
    """Names of the whole pages of `tokens` (a trailing partial page has none), continuing `parent`."""
    names = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start : start + page_size], key)
        names.append(parent)
    return names


@dataclass
class EventLog:
    """One instance's cache as its HTTP process publishes it (one cache per attention group under DP attention: a
    snapshot lists each group's names, and each group's events are its own)."""

    page_size: int
    model: str
    key_id: str = ""  # which key names the pages ("" unkeyed): keys.kv_names
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))
    seq: int = 0
    held: dict[int, collections.Counter[int]] = field(default_factory=dict)  # group -> name -> 1
    ring: collections.deque[tuple[int, int, Event]] = field(default_factory=lambda: collections.deque(maxlen=RING))

    ring_names: int = 0
    host: set[int] = field(default_factory=set)  # pages in the instance's host memory
    store: dict[int, None] = field(default_factory=dict)  # pages it wrote to the store, oldest first

    def apply(self, group: int, events: Iterable[Event]) -> None:
        held = self.held.setdefault(group, collections.Counter())
        for kind, names in events:
            if kind == "host_stored":
                self.host.update(names)
            elif kind == "host_removed":
                self.host.difference_update(names)
            elif kind == "store_stored":
                self.store.update(dict.fromkeys(names))
                for old in list(itertools.islice(self.store, max(0, len(self.store) - STORE_NAMES))):
                    del self.store[old]
            elif kind == "stored":
                held.update(names)
            elif kind == "removed":
                held.subtract(names)
                for n in names:
                    if held[n] <= 0:
                        del held[n]
            elif kind == "cleared":
                held.clear()
            self.seq += 1
            if len(self.ring) == self.ring.maxlen:
                self.ring_names -= len(self.ring[0][2][1])
            self.ring.append((self.seq, group, (kind, list(names))))
            self.ring_names += len(names)
            while self.ring_names > RING_NAMES and len(self.ring) > 1:
                self.ring_names -= len(self.ring.popleft()[2][1])

    def names(self) -> set[int]:
        return {n for held in self.held.values() for n in held}

    def holdings(self) -> dict[str, list[str]]:
        """Each attention group's names (a snapshot: the router scores every group)."""
        return {str(g): [f"{n:016x}" for n in held] for g, held in self.held.items()}

    def header(self) -> dict:
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "page_size": self.page_size,
            "model": self.model,
            "hash_scheme": HASH_SCHEME,
            "key_id": self.key_id,
        }

    def since(self, epoch: str, seq: int) -> dict:
        """What a reader that saw event `seq` of `epoch` lacks: the events after it, or a snapshot."""
        first = self.ring[0][0] if self.ring else self.seq + 1
        if epoch == self.epoch and seq == self.seq:
            return {**self.header(), "events": []}
        if epoch == self.epoch and first - 1 <= seq < self.seq:
            events = [
                {"seq": s, "group": g, "kind": k, "pages": [f"{n:016x}" for n in names]}
                for s, g, (k, names) in self.ring
                if s > seq
            ]
            return {**self.header(), "events": events}
        tiers = {"host": [f"{n:016x}" for n in self.host], "store": [f"{n:016x}" for n in self.store]}
        return {**self.header(), "snapshot": self.holdings(), **tiers}
