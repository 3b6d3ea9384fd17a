"""KV handoff health as the router sees it, from the reports the workers give on /health (router/worker.py
stores them): bootstrap and transfer failures per worker over a recent window, and handoff queues that hold
requests without progress.

A worker's handoff progresses when a transfer finishes or fails (its counters move). When one of its handoff
queues (prefill bootstrap/inflight, decode prealloc/transfer) holds requests and no handoff has progressed for
`stall_after_s`, the worker is stalled: requests sit there until a timeout or forever. The numbers are what the
router's /health reports under "handoff"; the operator turns them into status.transfer and HandoffStalled.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from disagg_worker.router.worker import Worker

HANDOFF_QUEUES = ("prefill_bootstrap", "prefill_inflight", "decode_prealloc", "decode_transfer")


@dataclass
class _Track:
    # (time, bootstrap failures, transfer failures) whenever they changed; the oldest is the window's baseline
    samples: deque[tuple[float, int, int]] = field(default_factory=deque)
    progress: int = -1
    progress_at: float = 0.0
    queues: dict[str, int] = field(default_factory=dict)


class HandoffMonitor:
    def __init__(
        self, window_s: float = 300.0, stall_after_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ):
        self.window_s = window_s
        self.stall_after_s = stall_after_s
        self.clock = clock
        self.tracks: dict[Worker, _Track] = {}

    def observe(self, workers: Iterable[Worker]) -> None:
        """Take in the latest report of each worker (call it as often as you like)."""
        now = self.clock()
        seen = set()
        for w in workers:
            counts = w.report.get("transfer")
            if not isinstance(counts, dict):
                continue
            seen.add(w)
            self._update(self.tracks.setdefault(w, _Track(progress_at=now)), w.report, counts, now)
        for gone in [w for w in self.tracks if w not in seen]:
            del self.tracks[gone]

    def _update(self, t: _Track, report: dict, counts: dict, now: float) -> None:
        bf, tf = int(counts.get("bootstrap_failures", 0)), int(counts.get("transfer_failures", 0))
        if t.samples and (bf, tf) < t.samples[-1][1:]:  # the worker restarted: its counters began again
            t.samples.clear()
        if not t.samples or t.samples[-1][1:] != (bf, tf):
            t.samples.append((now, bf, tf))
        while len(t.samples) > 1 and t.samples[1][0] <= now - self.window_s:
            t.samples.popleft()  # the second oldest is already before the window: it becomes the baseline
        t.queues = {q: int(n) for q, n in (report.get("queues") or {}).items() if q in HANDOFF_QUEUES}
        progress = bf + tf + int(counts.get("transfers", 0))
        if progress != t.progress or not any(t.queues.values()):
            t.progress, t.progress_at = progress, now

    def describe(self) -> dict:
        now = self.clock()
        workers = []
        for w, t in sorted(self.tracks.items(), key=lambda item: item[0].url):
            base, last = t.samples[0], t.samples[-1]  # the counts at the window's start (or first sight), and now
            stalled = now - t.progress_at >= self.stall_after_s
            workers.append(
                {
                    "pod": w.name,
                    "role": w.role,
                    "url": w.url,
                    "bootstrap_failures": last[1] - base[1],
                    "transfer_failures": last[2] - base[2],
                    "queued": sum(t.queues.values()),
                    "stalled_queues": sorted(q for q, n in t.queues.items() if n) if stalled else [],
                }
            )
        return {"window_s": int(self.window_s), "stall_after_s": int(self.stall_after_s), "workers": workers}
