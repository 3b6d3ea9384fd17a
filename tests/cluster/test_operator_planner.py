"""The SLO planner on a real API server: Advisory reports in status.planner and one Event and writes no
replicas; an unchanged decision writes nothing; in Apply an HPA on decode's scale subresource keeps decode
advisory.

kwok plays the kubelets: its pods have addresses nothing answers at, so the planner has no observations here and
holds the current replicas, saying so (the derivation from real /metrics is unit-tested, test_planner_scrape.py).
"""

from __future__ import annotations

import json
import time

import pytest
from test_operator_support import (
    POLL_S,
    OperatorUnderTest,
    apply_cr,
    events_for,
    install_chart,
    kube_timeout,
    load_example,
    scaled,
    wait_until,
)

from disagg_operator.config import OperatorConfig

TICK_S = OperatorConfig().tick_s  # the planner decides on the operator's tick


@pytest.fixture(scope="module")
def operator(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster)
    op = OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()


def advisory(**planner) -> dict:
    cr = load_example("dm-planner-advisory.yaml")
    for role in ("prefill", "decode"):
        cr["spec"][role].pop("resources", None)  # kwok nodes have room; keep scheduling trivial
    cr["spec"]["scaling"]["planner"].update(planner)
    return cr


def planner_status(cluster, namespace: str) -> dict | None:
    return (cluster.get("-n", namespace, "dm", "tiny").get("status") or {}).get("planner")


def test_advisory_reports_its_recommendation_and_writes_no_replicas(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, advisory(correctionIntervalSeconds=5, intervalSeconds=5))
    kube_cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", "dm/tiny", f"--timeout={kube_timeout(120)}")
    status = wait_until(lambda: planner_status(kube_cluster, namespace), 6 * TICK_S, POLL_S, "status.planner")
    assert status["mode"] == "Advisory"
    assert status["desired"] == {"prefill": 1, "decode": 1} and status["current"] == {"prefill": 1, "decode": 1}
    assert "worker pods did not answer /metrics" in status["reason"], status
    assert "observations missing: holding the current replicas" in status["reason"]
    assert status["unreachable"] == [] and status["lastDecisionTime"]
    events = [e for e in events_for(kube_cluster, namespace, "tiny") if e["reason"] == "PlannerRecommendation"]
    assert len(events) == 1 and events[0]["message"].startswith("Advisory: prefill 1, decode 1: "), events
    # Later decisions say the same: nothing is written (status, Event or replicas) over two more of them.
    mark = operator.proxy.write_mark()
    time.sleep(scaled(2 * TICK_S + 2))
    writes = operator.proxy.writes_in(namespace, mark)
    assert writes == [], (writes, operator.log_tail(20000))
    dm = kube_cluster.get("-n", namespace, "dm", "tiny")
    assert dm["spec"]["prefill"]["replicas"] == 1 and dm["spec"]["decode"]["replicas"] == 1
    assert dm["status"]["planner"]["lastDecisionTime"] == status["lastDecisionTime"]
    assert kube_cluster.get("-n", namespace, "sts", "tiny-decode")["spec"]["replicas"] == 1


def test_in_apply_an_hpa_on_decode_keeps_decode_advisory(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, advisory(mode="Apply", correctionIntervalSeconds=5, intervalSeconds=5))
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "tiny-decode"},
        "spec": {  # the model's own scale subresource is decode's
            "scaleTargetRef": {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedModel", "name": "tiny"},
            "minReplicas": 1,
            "maxReplicas": 3,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
                }
            ],
        },
    }
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(hpa))
    status = wait_until(
        lambda: (lambda s: s if s and s.get("advisoryRoles") else None)(planner_status(kube_cluster, namespace)),
        6 * TICK_S,
        POLL_S,
        "decode advisory",
    )
    assert status["mode"] == "Apply" and status["advisoryRoles"] == ["decode"]
    assert status["desired"] == {"prefill": 1, "decode": 1}
