"""What a worker's `/health` says beyond "ok": who it is (pod name, pairing revision), how its KV handoff goes
(P/D queue sizes and the transfer counters of its scheduler process) and its load (requests held, KV pages in use).
The router reads it to pair only workers of the same revision, to notice handoffs that fail or stall
(router/handoff.py) and to weigh load that other routers sent (router/worker.py)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from disagg_worker.env import WorkerEnv
from disagg_worker.request import messages as msg
from disagg_worker.server.groups import load

# Samples of the scheduler's own series, summed over instances, by the name /health reports them under.
COUNTERS = {
    "disagg_bootstrap_failures_total": "bootstrap_failures",
    "disagg_kv_transfer_failures_total": "transfer_failures",
    "disagg_kv_transfer_seconds_count": "transfers",
}


def transfer_counts(metrics_text: str) -> dict[str, int]:
    """Bootstrap failures, transfer failures and finished transfers so far, from the scheduler's exposition."""
    out = dict.fromkeys(COUNTERS.values(), 0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            key = COUNTERS.get(sample.name)
            if key:
                out[key] += int(sample.value)
    return out


def health_report(
    stats: msg.SchedulerStats | None,
    identity: WorkerEnv,
    groups: Mapping[int, msg.SchedulerStats] | None = None,
    dp_size: int = 1,
) -> dict:
    """The fields /health adds to its status: identity always, queues, counters and load once the scheduler
    reported, and with DP attention each attention group's load (`dp_loads`, by group; the router picks groups by
    it)."""
    report: dict = {"pod": identity.pod_name, "revision": identity.revision}
    if stats is not None:
        report["queues"] = dict(stats.queues)
        report["transfer"] = transfer_counts(stats.metrics_text)
        report["load"] = {"requests": load(stats), "kv_used": stats.pages_used, "kv_total": stats.pages_total}
    if groups is not None and dp_size > 1:
        report["dp_loads"] = [load(groups[g]) if g in groups else 0 for g in range(dp_size)]
    return report
