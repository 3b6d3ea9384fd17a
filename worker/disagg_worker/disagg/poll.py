"""Transfer status of one request (a "room") and the only place its transitions happen.

A status moves forward only (Bootstrapping -> WaitingForInput -> Transferring -> Success),
except that any non-terminal status may move to Failed. Success and Failed are terminal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from enum import IntEnum


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class StatusCell:
    """A thread-safe KVPoll value that enforces the forward-only rule.

    Invalid moves (backwards, sideways, out of a terminal status) are ignored and reported
    by the return value, never raised: a late message must not crash the caller. `on_change`
    is called (from the thread that moved it, outside the lock) after every move.
    """

    def __init__(self, initial: KVPoll = KVPoll.Bootstrapping, on_change: Callable[[], None] | None = None):
        self._lock = threading.Lock()
        self._status = initial
        self._reason = ""
        self._on_change = on_change

    def get(self) -> KVPoll:
        return self._status

    @property
    def reason(self) -> str:
        return self._reason

    def advance(self, new: KVPoll, then: Callable[[], None] | None = None) -> bool:
        """Move forward to `new` (not Failed); True if the status changed. `then` runs only if
        it changed, after the move and before `on_change`: for work that must not wait behind
        what `on_change` wakes."""
        if new is KVPoll.Failed:
            raise ValueError("use fail(reason) to move to Failed")
        with self._lock:
            if self._status.terminal or new <= self._status:
                return False
            self._status = new
        if then is not None:
            then()
        if self._on_change is not None:
            self._on_change()
        return True

    def fail(self, reason: str) -> bool:
        """Move to Failed with `reason`; True if the status changed (it was not terminal)."""
        with self._lock:
            if self._status.terminal:
                return False
            self._status = KVPoll.Failed
            self._reason = reason
        if self._on_change is not None:
            self._on_change()
        return True
