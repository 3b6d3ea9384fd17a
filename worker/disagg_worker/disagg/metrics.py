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
_GROUP_SECONDS = Histogram(
    "disagg_kv_layer_group_send_seconds",
    "Layer-wise streaming: latency of one layer group's writes to one decode rank (queued to all landed)",
    ["instance"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
_HIDDEN = Histogram(
    "disagg_kv_layer_hidden_ratio",
    "Layer-wise streaming: share of a forward's KV transfer that ran while the forward still computed",
    ["instance"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
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
        self._group_seconds = _GROUP_SECONDS.labels(instance)
        self._hidden = _HIDDEN.labels(instance)
        self._lock = threading.Lock()
        self.bootstrap_failures = 0
        self.transfer_failures = 0
        self.transfers = 0
        self.bytes_total = 0
        self.last_seconds = 0.0
        self.groups_sent = 0
        self.last_hidden_share: float | None = None

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

    def group_sent(self, seconds: float) -> None:
        """Layer-wise streaming: one layer group's writes to one decode rank settled."""
        with self._lock:
            self.groups_sent += 1
        self._group_seconds.observe(seconds)

    def stream_hidden(self, share: float) -> None:
        """Layer-wise streaming: the share of one forward's transfer its compute hid."""
        with self._lock:
            self.last_hidden_share = share
        self._hidden.observe(share)
