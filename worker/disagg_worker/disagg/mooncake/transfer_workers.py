"""Data-plane threads of a prefill manager: one per destination (decode transfer session).

A call into the transfer engine can block for a frozen peer (up to tens of seconds); with a
thread per destination that only delays the rooms going to that peer. Each worker submits
the writes of its jobs and polls them with a doubling sleep, never spinning a core.

Jobs to one destination finish about in the order they were started, so a poll walks them
oldest first and stops at the first one that is still waiting; a full pass every
`TUNING.transfer.full_poll_interval_s` catches a job that finished out of order. With many
rooms streaming to one decode instance that is one or two status reads per poll instead of
one per room.

A destination that is gone is `retire`d: its thread finishes the jobs it holds and exits; a later
job for it starts a new one.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Generic, TypeVar

from disagg_worker.tuning import TUNING

J = TypeVar("J")
_PR_SET_TIMERSLACK = 29  # prctl option (linux/prctl.h)


class Progress(Enum):
    """What one poll of a job found."""

    SETTLED = "settled"  # every write finished or failed: drop the job
    MOVED = "moved"  # something changed (writes landed, more were submitted, decode was told)
    WAITING = "waiting"  # nothing changed: its writes are still on the wire


def _tight_sleeps() -> None:
    """Let this thread's sleeps end close to their deadline (`TUNING.transfer.timer_slack_ns`)
    instead of after the default 50 us timer slack."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, TUNING.transfer.timer_slack_ns, 0, 0, 0)
        except (OSError, AttributeError):
            pass


class TransferWorkers(Generic[J]):
    def __init__(self, start: Callable[[J], None], progress: Callable[[J], Progress]):
        """`start(job)` submits a job's writes; `progress(job)` polls it and says whether it
        is settled (every write finished or failed), moved, or still waiting."""
        self._start = start
        self._progress = progress
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue[J | None]] = {}  # None: retire once the jobs held settled
        self._threads: dict[str, threading.Thread] = {}
        self._pending: dict[str, int] = {}  # jobs put and not yet settled, per destination

    def put(self, destination: str, job: J) -> None:
        with self._lock:
            q = self._queues.get(destination)
            if q is None:
                q = self._queues[destination] = queue.Queue()
                t = threading.Thread(
                    target=self._run, args=(destination, q), name=f"kv-transfer-{destination}", daemon=True
                )
                self._threads[destination] = t
                t.start()
            self._pending[destination] = self._pending.get(destination, 0) + 1
            q.put(job)  # under the lock: never behind the retirement mark of a queue retired meanwhile

    def busy(self, destination: str) -> bool:
        """Whether jobs for `destination` are queued or in flight."""
        with self._lock:
            return self._pending.get(destination, 0) > 0

    def retire(self, destination: str) -> None:
        """Release the thread of `destination` once the jobs it holds have settled (a peer that is gone)."""
        with self._lock:
            q = self._queues.pop(destination, None)
            if q is not None:
                q.put(None)

    @property
    def destinations(self) -> list[str]:
        """Destinations with a live thread."""
        with self._lock:
            return [d for d, t in self._threads.items() if t.is_alive()]

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            threads = list(self._threads.values())
        for t in threads:
            t.join(timeout=timeout)

    def _settled(self, destination: str, n: int) -> None:
        if n:
            with self._lock:
                self._pending[destination] -= n
                if not self._pending[destination]:
                    del self._pending[destination]

    def _run(self, destination: str, jobs: queue.Queue[J | None]) -> None:
        _tight_sleeps()
        t = TUNING.transfer
        active: list[J] = []
        sleep, next_full = t.poll_sleep_min_s, 0.0
        retiring = False
        while not self._stop.is_set() and not (retiring and not active):
            try:
                job = jobs.get(timeout=0.05) if not active else jobs.get_nowait()
                if job is None:
                    retiring = True
                    continue
                self._start(job)
                active.append(job)
                sleep = t.poll_sleep_min_s
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            full = now >= next_full
            next_full = now + t.full_poll_interval_s if full else next_full
            before = len(active)
            active = poll_in_order(active, self._progress, full)
            self._settled(destination, before - len(active))
            if active:
                sleep = t.poll_sleep_min_s if len(active) < before else min(2 * sleep, t.poll_sleep_max_s)
                time.sleep(sleep)
        with self._lock:
            if self._threads.get(destination) is threading.current_thread():
                del self._threads[destination]


def poll_in_order(active: list[J], progress: Callable[[J], Progress], full: bool) -> list[J]:
    """Poll `active` jobs oldest first; returns those not settled, in order. Unless `full`,
    stops at the first job still waiting: the ones behind it are most likely waiting too."""
    kept: list[J] = []
    for i, job in enumerate(active):
        found = progress(job)
        if found is not Progress.SETTLED:
            kept.append(job)
        if found is Progress.WAITING and not full:
            return kept + active[i + 1 :]
    return kept
