"""The series the shipped dashboard and alerts read beside the request metrics: a worker's role
(`disagg_instance_info`), the router's verified pairs and its stalled handoffs, as /metrics shows them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from disagg_worker.router.handoff import HandoffMonitor
from disagg_worker.router.metrics import PairCollector
from disagg_worker.server.metrics import ServerMetrics
from tests.unit.test_router_verify import Clock, setup, worker


def samples(text: str, name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def router_metrics(collector: PairCollector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_a_workers_metrics_name_its_role():
    text = ServerMetrics("127.0.0.1:8000", role="prefill").render().decode()
    assert samples(text, "disagg_instance_info") == {(("instance", "127.0.0.1:8000"), ("role", "prefill")): 1.0}


def test_the_router_counts_pairs_verified_and_not_and_goes_to_zero_when_a_worker_fails():
    p, d1, d2 = worker("http://p", "prefill"), worker("http://d1", "decode"), worker("http://d2", "decode")
    v, _ = setup(p, d1, d2)
    v.refresh()
    pairs = samples(router_metrics(PairCollector(v)), "disagg_router_pairs")
    assert pairs == {(("state", "verified"),): 0.0, (("state", "unverified"),): 2.0}
    v._record((p, d1), "")
    pairs = samples(router_metrics(PairCollector(v)), "disagg_router_pairs")
    assert pairs == {(("state", "verified"),): 1.0, (("state", "unverified"),): 1.0}
    p.healthy = False
    assert samples(router_metrics(PairCollector(v)), "disagg_router_pairs")[(("state", "verified"),)] == 0.0


def test_a_handoff_queue_without_progress_shows_as_stalled_until_a_transfer_finishes():
    clock = Clock()
    d = worker("http://d", "decode")
    v, _ = setup(d, monitor=HandoffMonitor(window_s=100, stall_after_s=30, clock=clock))
    key = (("role", "decode"), ("worker", "http://d"))

    def stalled(transfers: int) -> float:
        d.report.update(transfer={"bootstrap_failures": 0, "transfer_failures": 0, "transfers": transfers})
        d.report.update(queues={"decode_transfer": 2})
        v.monitor.observe([d])
        return samples(router_metrics(PairCollector(v)), "disagg_router_handoff_stalled")[key]

    assert stalled(10) == 0.0
    clock.now = 31
    assert stalled(10) == 1.0
    assert stalled(11) == 0.0  # one transfer finished: progress
