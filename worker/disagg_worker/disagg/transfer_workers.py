"""Data-plane threads of a prefill manager: one per destination (decode transfer session).

A call into the transfer engine can block for a frozen peer (up to tens of seconds); with a
thread per destination that only delays the rooms going to that peer. Each worker submits
the writes of its jobs and polls them with a doubling sleep, never spinning a core.
"""
from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
from typing import Callable, Generic, TypeVar

J = TypeVar("J")

# Sleep between status polls: starts short (small transfers finish in tens of microseconds)
# and doubles while nothing completes, up to the cap. The cap bounds how late a finished
# transfer is noticed (a sleep overshoots by ~80 us here); polling costs ~10 us of CPU.
POLL_SLEEP_MIN_S = 0.00001
POLL_SLEEP_MAX_S = 0.0002
_PR_SET_TIMERSLACK = 29


def _tight_sleeps() -> None:
    """Let this thread's sleeps end within ~1 us of their deadline instead of the default
    50 us timer slack (a 20 us sleep took ~120 us here, ~40 us with this)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        except (OSError, AttributeError):
            pass


class TransferWorkers(Generic[J]):
    def __init__(self, start: Callable[[J], None], progress: Callable[[J], bool]):
        """`start(job)` submits a job's writes; `progress(job)` polls it and returns True
        once it is settled (every write finished or failed)."""
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

    def _run(self, jobs: "queue.Queue[J]") -> None:
        _tight_sleeps()
        active: list[J] = []
        sleep = POLL_SLEEP_MIN_S
        while not self._stop.is_set():
            try:
                job = jobs.get(timeout=0.05) if not active else jobs.get_nowait()
                self._start(job)
                active.append(job)
                sleep = POLL_SLEEP_MIN_S
                continue
            except queue.Empty:
                pass
            before = len(active)
            active = [job for job in active if not self._progress(job)]
            if active:
                sleep = POLL_SLEEP_MIN_S if len(active) < before else min(2 * sleep, POLL_SLEEP_MAX_S)
                time.sleep(sleep)
