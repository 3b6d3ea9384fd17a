"""The endpoint picker's /metrics (Prometheus text, on --metrics-port): its answers and decisions (the endpoints
picked, in P/D mode the prefills), which endpoint served each request as the gateway reported it, and its pool as
the router's /metrics shows a pool (the router's own collector, `router/metrics.py`: endpoints' health, open
requests, the index of their prefix caches, and cache_aware's choices, under the router's names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from disagg_worker.epp.pick import Choice
from disagg_worker.router.metrics import PoolCollector
from disagg_worker.router.workers import WorkerPool

# Decision time buckets: the pick is in-process arithmetic plus, with cache_aware, tokenising the prompt.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class EppMetrics:
    def __init__(self, pool: WorkerPool | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        if pool is not None:
            self.registry.register(PoolCollector(pool))
        r = self.registry
        self.refusals = Counter(
            "disagg_epp_refused",
            "Requests the picker answered itself, by HTTP status (400/404: a body the workers refuse, 413: over "
            "the body limit, 429: shed, 503: no endpoint ready, 500: the picker failed)",
            ["code"],
            registry=r,
        )
        self.picks = Counter("disagg_epp_picked", "Requests sent to an endpoint, by endpoint", ["endpoint"], registry=r)
        self.prefill_picks = Counter(
            "disagg_epp_prefill_picked",
            "P/D mode: requests whose prefill the picker named (x-prefiller-host-port), by prefill",
            ["prefill"],
            registry=r,
        )
        self.served_by = Counter(
            "disagg_epp_served",
            "Responses by the endpoint the gateway reports as serving (x-gateway-destination-endpoint-served) and "
            "whether it is the one picked first (false: the gateway fell back, or reported none)",
            ["endpoint", "as_picked"],
            registry=r,
        )
        self.decision = Histogram(
            "disagg_epp_decision_seconds",
            "From a request's whole body to its pick: the body's check, its prompt's pages, the policy",
            buckets=DECISION_BUCKETS,
            registry=r,
        )

    def answered(self, status: int) -> None:
        self.refusals.labels(str(status)).inc()

    def picked(self, c: Choice, seconds: float) -> None:
        self.picks.labels(c.endpoints[0]).inc()
        if c.prefill is not None:
            self.prefill_picks.labels(c.prefiller).inc()
        self.decision.observe(seconds)

    def served(self, c: Choice, served: str) -> None:
        self.served_by.labels(served or "unreported", str(served == c.endpoints[0]).lower()).inc()
