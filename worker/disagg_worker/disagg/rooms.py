"""Per-manager table of live rooms plus tombstones of finished ones.

A room is never reused: once a room finished (Success, Failed or aborted) its id stays in a
bounded tombstone set, so a late message for it is dropped instead of being attached to a
new request that happens to carry the same id.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

from disagg_worker.tuning import TUNING

S = TypeVar("S")


class RoomTable(Generic[S]):
    def __init__(self, max_tombstones: int = TUNING.transfer.max_tombstones):
        self._lock = threading.Lock()
        self._live: dict[int, S] = {}
        self._tombstones: OrderedDict[int, str] = OrderedDict()
        self._max_tombstones = max_tombstones

    def add(self, room: int, state: S) -> bool:
        """Register a new room; False if the id is live or tombstoned (a reused room)."""
        with self._lock:
            if room in self._live or room in self._tombstones:
                return False
            self._live[room] = state
            return True

    def get(self, room: int) -> S | None:
        with self._lock:
            return self._live.get(room)

    def retire(self, room: int, outcome: str) -> S | None:
        """Drop a live room and remember its outcome; returns its state if it was live."""
        with self._lock:
            state = self._live.pop(room, None)
            self._tombstones[room] = outcome
            self._tombstones.move_to_end(room)
            while len(self._tombstones) > self._max_tombstones:
                self._tombstones.popitem(last=False)
            return state

    def tombstone(self, room: int) -> str | None:
        """The recorded outcome of a finished room, or None if it never finished here."""
        with self._lock:
            return self._tombstones.get(room)

    def snapshot(self) -> list[tuple[int, S]]:
        with self._lock:
            return list(self._live.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def __iter__(self) -> Iterator[int]:
        return iter([room for room, _ in self.snapshot()])
