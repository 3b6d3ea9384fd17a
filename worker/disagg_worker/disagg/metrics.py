"""Per-instance KV transfer metrics: plain attributes for callers and tests, mirrored into
Prometheus series labelled by `instance`."""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = Histogram(
    "disagg_kv_transfer_seconds",
    "Latency of one finished KV transfer (first send to all writes landed)",
    ["instance"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
_BYTES = Counter("disagg_kv_transfer_bytes_total", "KV bytes moved by finished transfers", ["instance"])
_FAILURES = Counter("disagg_kv_transfer_failures_total", "KV transfers that failed", ["instance"])
_BOOTSTRAP_FAILURES = Counter(
    "disagg_bootstrap_failures_total", "Rooms that failed before their transfer started", ["instance"]
)
_GBPS = Gauge("disagg_kv_transfer_gbps", "Throughput of the last finished KV transfer (GB/s)", ["instance"])


class TransferMetrics:
    """Counters of one manager. Methods are thread-safe and cheap."""

    def __init__(self, instance: str):
        self.instance = instance
        # The labelled children, bound once: `labels()` costs more than the update itself.
        self._seconds = _SECONDS.labels(instance)
        self._bytes = _BYTES.labels(instance)
        self._failures = _FAILURES.labels(instance)
        self._bootstrap_failures = _BOOTSTRAP_FAILURES.labels(instance)
        self._gbps = _GBPS.labels(instance)
        self._lock = threading.Lock()
        self.bootstrap_failures = 0
        self.transfer_failures = 0
        self.transfers = 0
        self.bytes_total = 0
        self.last_seconds = 0.0

    def bootstrap_failed(self) -> None:
        with self._lock:
            self.bootstrap_failures += 1
        self._bootstrap_failures.inc()

    def transfer_failed(self) -> None:
        with self._lock:
            self.transfer_failures += 1
        self._failures.inc()

    def transfer_done(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.transfers += 1
            self.bytes_total += nbytes
            self.last_seconds = seconds
        self._seconds.observe(seconds)
        self._bytes.inc(nbytes)
        if seconds > 0:
            self._gbps.set(nbytes / seconds / 1e9)
