"""Two operator replicas as the chart's HA setting runs them (`replicas: 2`, kopf peering): one reconciles,
the other stands by, and when the active one stops, the standby converges what changed meanwhile.

kopf pauses every operator that sees a live peer of its own priority, itself included: replicas started with
one fixed priority would never reconcile. The operator ranks replicas by start time (`main.seniority_priority`).
"""

from __future__ import annotations

import pytest
from test_operator_support import (
    POLL_S,
    RELEASE,
    OperatorUnderTest,
    apply_cr,
    install_chart,
    load_example,
    wait_until,
)

from disagg_operator.main import seniority_priority


def test_an_older_replica_ranks_higher_and_replicas_started_together_differ() -> None:
    assert seniority_priority(1000.0) > seniority_priority(1000.001)
    # Two replicas of a Deployment scaled from 0 to 2 started in the same millisecond on the real node: with
    # one priority, kopf paused both and nothing was reconciled.
    assert len({seniority_priority(1795619366.512) for _ in range(100)}) > 90
    assert all(-(2**63) < seniority_priority(4102444800.0) < 0 for _ in range(10))  # the year 2100 fits int64


@pytest.fixture
def peers(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster, "--set", "replicas=2")  # makes the ClusterKopfPeering object
    peering = kube_cluster.get("clusterkopfpeerings")["items"]
    assert [p["metadata"]["name"] for p in peering] == [RELEASE]
    args = ("--all-namespaces", f"--peering={RELEASE}")
    ops = [OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp(f"operator{i}"), args) for i in range(2)]
    try:
        for op in ops:  # one after the other: the first is the older
            op.start()
        # Both have announced themselves: from here on each sees the other.
        wait_until(lambda: len(_peers(kube_cluster)) == 2, 30, POLL_S, what="both replicas in the peering")
        yield ops
    finally:
        for op in ops:
            op.stop()
        install_chart(kube_cluster)  # back to the single replica the other modules expect


def _peers(cluster) -> dict:
    return cluster.get(f"clusterkopfpeerings/{RELEASE}").get("status") or {}


def _decode_replicas(cluster, namespace: str) -> int | None:
    sts = cluster.get("-n", namespace, "statefulsets", "-l", "disagg.dev/model=tiny,disagg.dev/role=decode")
    return sts["items"][0]["spec"]["replicas"] if sts["items"] else None


def test_one_replica_reconciles_and_the_standby_takes_over(kube_cluster, namespace, peers) -> None:
    active, standby = peers
    apply_cr(kube_cluster, namespace, load_example("dm-cpu-tcp.yaml"))
    wait_until(lambda: _decode_replicas(kube_cluster, namespace) == 1, 60, POLL_S, what="the decode StatefulSet")
    # The children were written by the older replica alone.
    assert active.proxy.writes_in(namespace), active.log_tail()
    assert not standby.proxy.writes_in(namespace), standby.log_tail()

    active.stop()  # gracefully: it takes its record out of the peering object on its way out
    # The standby need not wait for the record to expire (kopf's peering lifetime, a minute).
    wait_until(lambda: len(_peers(kube_cluster)) == 1, 30, POLL_S, what="the stopped replica leaving the peering")
    mark = standby.proxy.write_mark()
    kube_cluster.kubectl("-n", namespace, "scale", "dm/tiny", "--replicas=2")
    wait_until(
        lambda: _decode_replicas(kube_cluster, namespace) == 2,
        60,
        POLL_S,
        what=f"the standby scaling decode (log: {standby.log_tail()})",
    )
    assert standby.proxy.writes_in(namespace, since=mark)
