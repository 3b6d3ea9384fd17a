"""The host tier (L2): KV pages kept in host memory under their names, least recently used out first.

A slot holds one page of every KV buffer of the instance (the model's K and V, or MLA latents, per layer, and a
draft model's when it has a pool of its own), copied byte for byte: a page loaded back into any free page of the
pool is the page that was written down. Slots are keyed by the page's name (`kv_events.page_hash`: the chained
hash of its whole prefix), so a name found here holds that prefix's KV and nothing else.

The region is bounded at construction: on a CPU an anonymous private map per buffer (resident only where written,
like the KV pool's), on a GPU pinned host memory, so that copies to and from the device run asynchronously.

It is used from two threads, the scheduler's and the store's prefetch, so every method holds the tier's lock.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import threading
from collections.abc import Callable, Sequence

import torch

Evicted = Callable[[list[int], list[bytes]], None]  # names dropped from the tier, and their bytes (if asked for)


def _region(slots: int, nbytes: int, pinned: bool) -> torch.Tensor:
    """`slots` rows of `nbytes` bytes, zeroed."""
    if pinned:
        return torch.zeros((slots, nbytes), dtype=torch.uint8, pin_memory=True)
    raw = mmap.mmap(-1, max(1, slots * nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(raw, dtype=torch.uint8)[: slots * nbytes].view(slots, nbytes)


def page_rows(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each KV buffer `[num_pages, ...]` as `[num_pages, page_bytes]` bytes (the same memory)."""
    return [b.view(b.shape[0], -1).view(torch.uint8) for b in buffers]


class HostTier:
    def __init__(self, buffers: Sequence[torch.Tensor], slots: int, on_evict: Evicted | None = None):
        """A tier of `slots` pages shaped like `buffers` (the pool's, in `KVPool.buffers()` order). `on_evict` is
        told of the pages dropped to make room, with their bytes when `evicted_bytes` (write-back to the store)."""
        if slots < 1:
            raise ValueError(f"a host tier needs slots, got {slots}")
        self.rows = page_rows(buffers)
        pinned = self.rows[0].device.type == "cuda"
        self.host = [_region(slots, r.shape[1], pinned) for r in self.rows]
        self.slots = slots
        self.on_evict = on_evict
        self.evicted_bytes = True
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # name -> slot, LRU first
        self._free = list(range(slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._lock = threading.RLock()

    @property
    def page_nbytes(self) -> int:
        return sum(h.shape[1] for h in self.host)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, name: int) -> bool:
        with self._lock:
            return name in self._slot_of

    def names(self) -> set[int]:
        with self._lock:
            return set(self._slot_of)

    def run_of(self, names: Sequence[int]) -> int:
        """How many of `names`, from the first, are here; they become the most recently used."""
        with self._lock:
            n = 0
            for name in names:
                if name not in self._slot_of:
                    break
                self._slot_of.move_to_end(name)
                n += 1
            return n

    def pin(self, names: Sequence[int]) -> None:
        """Keep `names` while they are loaded (`unpin` after)."""
        with self._lock:
            self._pinned.update(names)

    def unpin(self, names: Sequence[int]) -> None:
        with self._lock:
            self._pinned.difference_update(names)

    def save(self, names: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Copy pool `pages` down under `names` (those already here are only refreshed); return the names
        written. Stops early when every slot is pinned."""
        with self._lock:
            todo = [(n, p) for n, p in zip(names, pages, strict=True) if n not in self._slot_of]
            for n in names:
                if n in self._slot_of:
                    self._slot_of.move_to_end(n)
            slots = self._take(len(todo))
            todo = todo[: len(slots)]
            if todo:
                index = torch.tensor([p for _, p in todo], dtype=torch.long, device=self.rows[0].device)
                at = torch.tensor(slots, dtype=torch.long)
                for row, host in zip(self.rows, self.host, strict=True):
                    host.index_copy_(0, at, row.index_select(0, index).cpu())
                for (n, _), s in zip(todo, slots, strict=True):
                    self._slot_of[n] = s
            return [n for n, _ in todo]

    def put_bytes(self, names: Sequence[int], values: Sequence[bytes]) -> int:
        """Take pages fetched from the store; return how many were taken (from the first)."""
        with self._lock:
            fresh = [(n, v) for n, v in zip(names, values, strict=True) if n not in self._slot_of]
            slots = self._take(len(fresh))
            for (n, v), s in zip(fresh, slots, strict=False):
                flat = torch.frombuffer(bytearray(v), dtype=torch.uint8)
                start = 0
                for host in self.host:
                    width = host.shape[1]
                    host[s].copy_(flat[start : start + width])
                    start += width
                self._slot_of[n] = s
            return len(slots) + len(names) - len(fresh)

    def load(self, names: Sequence[int], pages: Sequence[int]) -> None:
        """Copy the pages named `names` (all here) into pool `pages`."""
        with self._lock:
            at = torch.tensor([self._slot_of[n] for n in names], dtype=torch.long)
            index = torch.tensor(list(pages), dtype=torch.long, device=self.rows[0].device)
            for row, host in zip(self.rows, self.host, strict=True):
                row.index_copy_(0, index, host.index_select(0, at).to(row.device, non_blocking=True))

    def page_bytes(self, name: int) -> bytes:
        """The bytes of the page named `name` (here), every buffer's in order: what the store keeps."""
        with self._lock:
            s = self._slot_of[name]
            return b"".join(host[s].numpy().tobytes() for host in self.host)

    def pool_bytes(self, pages: Sequence[int]) -> list[bytes]:
        """The bytes of pool `pages` as the store keeps a page (for pages host memory had no room for)."""
        return [b"".join(row[p].cpu().numpy().tobytes() for row in self.rows) for p in pages]

    def _take(self, n: int) -> list[int]:
        """Up to `n` free slots, evicting the least recently used unpinned pages as needed."""
        need = n - len(self._free)
        victims = list(itertools.islice((m for m in self._slot_of if m not in self._pinned), max(0, need)))
        data = [self.page_bytes(m) for m in victims] if self.on_evict is not None and self.evicted_bytes else []
        for m in victims:
            self._free.append(self._slot_of.pop(m))
        if victims and self.on_evict is not None:
            self.on_evict(victims, data)
        return [self._free.pop() for _ in range(min(n, len(self._free)))]
