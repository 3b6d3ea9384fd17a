"""The router's GET /metrics (Prometheus text): how it routed requests, its workers as it sees them, and its
index of their prefix caches (`kv_index.py`), and its flow-control queue (`flow_control.py`).

Read from the pool at each scrape (a collector over the pool), so that the numbers are the ones /health shows
and nothing here keeps state of its own. Like a worker's /metrics, it takes the client API key when keys are on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from disagg_worker.http.flow_gate import NO_FLOW_CONTROL, FlowControl
from disagg_worker.router.flow_control import FlowCollector
from disagg_worker.router.stall import Verdict
from disagg_worker.router.verify import PairVerifier
from disagg_worker.router.workers import WorkerPool

# How the cache-aware policy picked a request's prefill, or that decode computed the prompt itself.
DECISIONS = ("cache_hit", "load", "balanced", "decode_only")
INDEX_STATES = ("ok", "silent", "mismatch", "unknown")
MIGRATION_CAUSES = ("connection", "ended", "stall", "timeout", "error_event")


class PoolCollector:
    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        pool, now = self.pool, time.monotonic()
        routes = CounterMetricFamily(
            "disagg_router_requests_routed",
            "Attempts (a retry counts again) sent to a prefill/decode pair or to decode alone",
            labels=["path"],
        )
        for path in ("pd", "decode_only"):
            routes.add_metric([path], pool.routes.get(path, 0))
        decisions = CounterMetricFamily(
            "disagg_router_cache_aware_decisions", "cache_aware's choices by kind (see Policy)", labels=["kind"]
        )
        for kind in DECISIONS:
            decisions.add_metric([kind], pool.decisions.get(kind, 0))
        failed = CounterMetricFamily(
            "disagg_router_requests_failed_instance",
            "Requests held by an instance when it failed: answered 500, not retried on another instance",
        )
        failed.add_metric([], pool.failed_instances)
        migrations = CounterMetricFamily(
            "disagg_router_migrations",
            "Streamed choices that went on on another pair when their decode failed, by cause (connection: it "
            "dropped; ended: its stream stopped before [DONE]; stall: it sent nothing within --stream-stall-timeout; "
            "timeout: --request-timeout; error_event: it sent an error the request did not cause)",
            labels=["cause"],
        )
        for cause in MIGRATION_CAUSES:
            migrations.add_metric([cause], pool.migrations.get(cause, 0))
        retries = CounterMetricFamily(
            "disagg_router_retries",
            "Requests tried again on another pair before their first token, by the side that failed (prefill: it "
            "refused or failed first, and decode's half was cancelled at once; decode; pair: both)",
            labels=["side"],
        )
        for side in ("prefill", "decode", "pair"):
            retries.add_metric([side], pool.retries.get(side, 0))
        stalls = CounterMetricFamily(
            "disagg_router_stream_stalls",
            "Streams that sent nothing within --stream-stall-timeout, by whose the stall was (decode: none of its "
            "decode's streams delivered meanwhile, and it was held out of rotation; request: the others went on)",
            labels=["verdict"],
        )
        for v in Verdict:
            stalls.add_metric([v.value], pool.stalls.get(v.value, 0))
        yield from (routes, decisions, failed, migrations, retries, stalls)
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily("disagg_router_worker_healthy", "1 while its /health is 200", labels=labels)
        inflight = GaugeMetricFamily("disagg_router_worker_inflight", "This router's requests on it", labels=labels)
        held = GaugeMetricFamily(
            "disagg_router_worker_held_out", "1 while out of rotation after its streams stalled", labels=labels
        )
        pages = GaugeMetricFamily("disagg_router_kv_index_pages", "Prefix-cache pages indexed", labels=labels)
        age = GaugeMetricFamily(
            "disagg_router_kv_index_age_seconds", "Since the worker's KV events were last applied", labels=labels
        )
        snapshots = CounterMetricFamily("disagg_router_kv_index_snapshots", "Snapshots taken", labels=labels)
        events = CounterMetricFamily("disagg_router_kv_index_events", "KV events applied", labels=labels)
        state = GaugeMetricFamily(
            "disagg_router_kv_index_state",
            "1 for the index's state (ok, silent, mismatch, unknown)",
            labels=[*labels, "state"],
        )
        for w in pool.workers():
            key = [w.url, w.role]  # the URL, stable (a pod name appears only once the worker reported)
            healthy.add_metric(key, float(w.healthy))
            inflight.add_metric(key, w.inflight)
            held.add_metric(key, float(w.held_out(now)))
            if not pool.indexed(w):
                continue
            i, current = pool.kv_index.known(w.url), pool.kv_index.status(w.url, now)[0]
            pages.add_metric(key, len(i.names))
            snapshots.add_metric(key, i.snapshots)
            events.add_metric(key, i.events)
            if i.updated is not None:
                age.add_metric(key, now - i.updated)
            for s in INDEX_STATES:
                state.add_metric([*key, s], float(s == current))
        yield from (healthy, inflight, held, pages, age, snapshots, events, state)


class PairCollector:
    """Pair verification and KV handoff health (`verify.py`, `handoff.py`): what /health shows under "pairs" and
    "handoff", and what the operator turns into PairingVerified and HandoffStalled."""

    def __init__(self, verifier: PairVerifier):
        self.verifier = verifier

    def collect(self) -> Iterator[Metric]:
        v = self.verifier
        pairs = GaugeMetricFamily(
            "disagg_router_pairs",
            "Prefill->decode pairs of one revision, by whether they may carry requests now",
            labels=["state"],
        )
        usable = sum(v.usable(p, d) for p, d in v.states)
        pairs.add_metric(["verified"], usable)
        pairs.add_metric(["unverified"], len(v.states) - usable)
        stalled = GaugeMetricFamily(
            "disagg_router_handoff_stalled",
            "1 while a handoff queue of the worker holds requests and no transfer finished or failed for "
            "--stall-after seconds",
            labels=["worker", "role"],
        )
        for w in v.monitor.describe()["workers"]:
            stalled.add_metric([w["url"], w["role"]], float(bool(w["stalled_queues"])))
        yield from (pairs, stalled)


def metrics_handler(pool: WorkerPool, verifier: PairVerifier | None = None, flow: FlowControl = NO_FLOW_CONTROL):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(pool))
    registry.register(FlowCollector(flow))
    if verifier is not None:
        registry.register(PairCollector(verifier))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics
