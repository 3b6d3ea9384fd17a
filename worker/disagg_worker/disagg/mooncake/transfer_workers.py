"""Data-plane threads of a prefill manager: one per destination (decode transfer session).

A call into the transfer engine can block for a frozen peer (up to tens of seconds); with a
thread per destination that only delays the rooms going to that peer. Each worker submits
the writes of its jobs and polls them with a doubling sleep, never spinning a core.

Jobs to one destination finish about in the order they were started, so a poll walks them
oldest first and stops at the first one that is still waiting; a full pass every
`TUNING.transfer.full_poll_interval_s` catches a job that finished out of order. With many
rooms streaming to one decode instance that is one or two status reads per poll instead of
one per room.
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
        self._queues: dict[str, queue.Queue[J]] = {}
        self._threads: list[threading.Thread] = []

    def put(self, destination: str, job: J) -> None:
        with self._lock:
            q = self._queues.get(destination)
            if q is None:
                q = self._queues[destination] = queue.Queue()
                t = threading.Thread(target=self._run, args=(q,), name=f"kv-transfer-{destination}", daemon=True)
                self._threads.append(t)
                t.start()
        q.put(job)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=timeout)

    def _run(self, jobs: queue.Queue[J]) -> None:
        _tight_sleeps()
        t = TUNING.transfer
        active: list[J] = []
        sleep, next_full = t.poll_sleep_min_s, 0.0
        while not self._stop.is_set():
            try:
                job = jobs.get(timeout=0.05) if not active else jobs.get_nowait()
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
            if active:
                sleep = t.poll_sleep_min_s if len(active) < before else min(2 * sleep, t.poll_sleep_max_s)
                time.sleep(sleep)


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
