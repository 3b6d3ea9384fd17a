"""The SLO planner reads the workers' /metrics from the operator's pods: while a model has a planner, its worker
NetworkPolicies admit exactly those pods to the serving port (nothing more, and nothing at all without one)."""

import copy

import pytest

from disagg_operator import names
from disagg_operator.builders import build_children
from disagg_operator.config import OperatorConfig, parse_labels
from disagg_operator.spec import ModelSpec
from tests.unit.test_operator_builders import load_example

OPERATOR = OperatorConfig(
    namespace="disagg-system",
    pod_labels=(("app.kubernetes.io/name", "disagg-operator"), ("app.kubernetes.io/instance", "rel")),
)
PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "disagg-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "disagg-operator", "app.kubernetes.io/instance": "rel"}},
}


def planned(mode: str = "Advisory") -> dict:
    cr = copy.deepcopy(load_example("dm-cpu-tcp.yaml"))
    cr["spec"]["scaling"] = {"slo": {"ttftMs": 500, "itlMs": 50}, "planner": {"mode": mode}}
    return cr


def policies(cr: dict, cfg: OperatorConfig) -> dict[str, list[dict]]:
    kids = build_children(ModelSpec.from_cr(cr), cfg)
    return {c["metadata"]["name"]: c["spec"]["ingress"] for c in kids if c["kind"] == "NetworkPolicy"}


@pytest.mark.parametrize("mode", ["Advisory", "Apply"])
def test_a_planned_models_workers_let_the_operators_pods_read_their_metrics(mode):
    got = policies(planned(mode), OPERATOR)
    for role in names.WORKER_ROLES:
        rule = {"ports": [{"protocol": "TCP", "port": names.HTTP_PORT}], "from": [PEER]}
        assert rule in got[f"tiny-{role}"], role
    # The router's port is open to anyone already; the operator gets nothing beyond the workers' serving port.
    assert not [r for r in got["tiny-router"] if PEER in r.get("from", [])]
    for role in names.WORKER_ROLES:
        assert [r["ports"] for r in got[f"tiny-{role}"] if PEER in r.get("from", [])] == [
            [{"protocol": "TCP", "port": names.HTTP_PORT}]
        ]


def test_no_rule_without_a_planner_or_without_knowing_the_operators_pods():
    plain = policies(load_example("dm-cpu-tcp.yaml"), OPERATOR)
    off = planned("Off")
    off["spec"]["scaling"].pop("slo")
    for got in (plain, policies(off, OPERATOR), policies(planned(), OperatorConfig())):
        assert not [r for rules in got.values() for r in rules if PEER in r.get("from", [])]
    # A model without a planner keeps exactly the policies it had: nothing of its pods' protection changes.
    assert plain == policies(load_example("dm-cpu-tcp.yaml"), OperatorConfig())


def test_the_operators_pods_are_read_from_its_environment():
    cfg = OperatorConfig.from_env(
        {
            "DISAGG_OPERATOR_NAMESPACE": "disagg-system",
            "DISAGG_OPERATOR_POD_LABELS": "app.kubernetes.io/name=disagg-operator, app.kubernetes.io/instance=rel",
        }
    )
    assert cfg.pod_peer == PEER
    assert OperatorConfig.from_env({}).pod_peer is None
    assert parse_labels("") == ()
    with pytest.raises(ValueError, match="'oops' is not key=value"):
        parse_labels("a=b,oops")
