"""The queue of requests waiting for an in-flight slot: pure and synchronous (time is passed in, nothing awaits).

The rules, once:
- one band per priority; `pop` serves the highest non-empty band first, so a band never waits for a lower one;
- inside a band, flows are served round-robin, one request per turn (a flow that empties leaves the ring, one that
  arrives joins at its end). Per request, not per token: a request's token cost is unknown at admission (its
  output length is known only when it ends). The Gateway API Inference Extension's flow control offers the same
  round-robin among its fairness policies; its default, global-strict, serves a band's oldest request first,
  which lets one flow's burst hold back every other flow of its band, what this queue is for. Within a flow,
  first in first out;
- each entry has a deadline, its enqueue time plus the time to live; `expire(now)` takes out those past it;
- the queue holds at most `capacity` entries. When full, the entry shed is taken from the lowest queued band, from
  its flow holding the most (ties: the one whose newest came last), and is that flow's newest (the one that has
  waited least). A request of a band above the lowest evicts it and takes its place; a request of the lowest band
  does so only when that flow holds at least two more than the request's own flow (so one tenant's burst cannot
  fill the queue against the others of its band, and two flows of equal share never trade places); any other
  request, and one of a band below the lowest, is refused.
Every entry pushed leaves exactly once: popped (dispatched), expired, evicted, removed (its client left), or it
is still queued.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class Entry(Generic[T]):
    """One waiting request: `item` is whatever its caller waits on (an asyncio future in the admission)."""

    item: T
    priority: int
    flow: str
    deadline: float
    seq: int  # arrival order over the whole queue


@dataclass(frozen=True)
class Pushed(Generic[T]):
    """What `push` did: `entry` is None when the request was refused (the queue full, nothing below it);
    `evicted` is the entry it displaced, if any."""

    entry: Entry[T] | None
    evicted: Entry[T] | None = None


@dataclass
class _Band(Generic[T]):
    flows: dict[str, deque[Entry[T]]] = field(default_factory=dict)
    ring: deque[str] = field(default_factory=deque)  # flows with entries, in their turn's order
    size: int = 0

    def add(self, entry: Entry[T]) -> None:
        if entry.flow not in self.flows:
            self.flows[entry.flow] = deque()
            self.ring.append(entry.flow)
        self.flows[entry.flow].append(entry)
        self.size += 1

    def pop(self) -> Entry[T]:
        flow = self.ring.popleft()
        entries = self.flows[flow]
        entry = entries.popleft()
        self.size -= 1
        if entries:
            self.ring.append(flow)  # its next request waits for the other flows' turns
        else:
            del self.flows[flow]
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        entries = self.flows.get(entry.flow)
        if entries is None or entry not in entries:
            return False
        entries.remove(entry)
        self.size -= 1
        if not entries:
            del self.flows[entry.flow]
            self.ring.remove(entry.flow)
        return True

    def shed_candidate(self) -> Entry[T]:
        """The newest entry of the flow holding the most (ties: the flow whose newest came last)."""
        return max((entries[-1] for entries in self.flows.values()), key=lambda e: (len(self.flows[e.flow]), e.seq))

    def expired(self, now: float) -> list[Entry[T]]:
        """Entries past their deadline: within a flow the oldest first (one time to live for all)."""
        gone = [e for entries in self.flows.values() for e in entries if e.deadline <= now]
        for e in gone:
            self.remove(e)
        return gone


class FlowQueue(Generic[T]):
    """Bands of flows of waiting entries, bounded by `capacity`, each entry living `ttl_s` (see the module)."""

    def __init__(self, capacity: int, ttl_s: float):
        if capacity < 1 or ttl_s <= 0:
            raise ValueError("a flow queue needs a capacity of at least 1 and a positive time to live")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._bands: dict[int, _Band[T]] = {}
        self._seq = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, item: T, priority: int, flow: str, now: float) -> Pushed[T]:
        """Queue `item` (see the module for what happens when the queue is full)."""
        evicted = None
        if self._size >= self.capacity:
            evicted = self._shed_for(priority, flow)
            if evicted is None:
                return Pushed(None)
            self._take(evicted)
        entry = Entry(item, priority, flow, now + self.ttl_s, self._seq)
        self._seq += 1
        self._bands.setdefault(priority, _Band()).add(entry)
        self._size += 1
        return Pushed(entry, evicted)

    def pop(self) -> Entry[T] | None:
        """The next entry to dispatch: the highest band's next flow's oldest; None when empty."""
        if not self._bands:
            return None
        priority = max(self._bands)
        entry = self._bands[priority].pop()
        self._size -= 1
        self._forget(priority)
        return entry

    def expire(self, now: float) -> list[Entry[T]]:
        """Take out and return every entry whose deadline is `now` or before."""
        gone: list[Entry[T]] = []
        for priority in list(self._bands):
            gone += self._bands[priority].expired(now)
            self._forget(priority)
        self._size -= len(gone)
        return gone

    def remove(self, entry: Entry[T]) -> bool:
        """Take `entry` out (its client left); False when it is no longer queued."""
        band = self._bands.get(entry.priority)
        if band is None or not band.remove(entry):
            return False
        self._size -= 1
        self._forget(entry.priority)
        return True

    def by_band(self) -> dict[int, int]:
        """Entries queued in each non-empty band."""
        return {p: band.size for p, band in self._bands.items()}

    def by_flow(self) -> dict[tuple[int, str], int]:
        """Entries queued for each (band, flow) with some."""
        return {(p, f): len(es) for p, band in self._bands.items() for f, es in band.flows.items()}

    def _shed_for(self, priority: int, flow: str) -> Entry[T] | None:
        """The entry a request of (`priority`, `flow`) displaces from the full queue; None: it is refused."""
        lowest = min(self._bands)
        if priority < lowest:
            return None
        band = self._bands[lowest]
        candidate = band.shed_candidate()
        if priority == lowest and len(band.flows[candidate.flow]) < len(band.flows.get(flow, ())) + 2:
            return None
        return candidate

    def _take(self, entry: Entry[T]) -> None:
        self._bands[entry.priority].remove(entry)
        self._size -= 1
        self._forget(entry.priority)

    def _forget(self, priority: int) -> None:
        if not self._bands[priority].size:
            del self._bands[priority]
