"""Objects that protect the pods: the bootstrap Service, PodDisruptionBudgets and one NetworkPolicy per role (and
one for the kvstore pod)."""

from typing import Any

from .. import names
from ..config import DEFAULT_CFG, OperatorConfig
from ..spec import ModelSpec
from .common import front_end_labels, metadata, selector_labels
from .ports import Listener, role_listeners


def build_bootstrap_service(spec: ModelSpec) -> dict[str, Any]:
    """A ClusterIP Service in front of the prefill pods' bootstrap servers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, names.bootstrap_service_name(spec.name), "bootstrap", names.PREFILL),
        "spec": {
            "type": "ClusterIP",
            "selector": front_end_labels(spec, names.PREFILL),
            "ports": [
                {"name": "bootstrap", "port": names.BOOTSTRAP_PORT, "targetPort": "bootstrap", "protocol": "TCP"}
            ],
        },
    }


def build_pdb(spec: ModelSpec, role: str) -> dict[str, Any]:
    """At most one pod of a role is evicted at a time; a pod that is not Ready may always be evicted.

    A pod that is not Ready serves nothing: a router while no prefill->decode pair is verified, a worker in its
    startup probe while it loads weights. Counting it against the budget would block a node drain on it.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(spec, names.child_name(spec.name, role), role, role),
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": selector_labels(spec, role)},
        },
    }


def _ingress_rule(spec: ModelSpec, listener: Listener) -> dict[str, Any]:
    port: dict[str, Any] = {"protocol": "TCP", "port": listener.first}
    if listener.last > listener.first:
        port["endPort"] = listener.last
    rule: dict[str, Any] = {"ports": [port]}
    if listener.peers is not None:
        rule["from"] = [{"podSelector": {"matchLabels": selector_labels(spec, peer)}} for peer in listener.peers]
    return rule


def build_network_policy(spec: ModelSpec, role: str, cfg: OperatorConfig = DEFAULT_CFG) -> dict[str, Any]:
    """Ingress to one role's pods: exactly the ports they listen on (`ports.role_listeners`), each from exactly
    the pods that connect to it; everything else is refused. The transfer engine has no authentication of its
    own: only this model's peer role reaches its ports. While the SLO planner runs, the operator's pods read the
    workers' /metrics on their serving port too (`_planner_rule`)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(spec, names.network_policy_name(spec.name, role), role, role),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec, role)},
            "policyTypes": ["Ingress"],
            "ingress": [_ingress_rule(spec, listener) for listener in role_listeners(spec, role)]
            + _group_rule(spec, role)
            + _planner_rule(spec, role, cfg),
        },
    }


def _group_rule(spec: ModelSpec, role: str) -> list[dict[str, Any]]:
    """The pods of a role whose instances span nodes reach one another on every port: the ranks' collectives (gloo,
    NCCL) connect on ports of their own choosing, after meeting at the leader's `DIST_PORT`."""
    if role not in names.WORKER_ROLES or spec.worker(role).nodes == 1:
        return []
    group = {**selector_labels(spec, role), names.LWS_NAME_LABEL: names.group_set_name(spec.name, role)}
    return [{"from": [{"podSelector": {"matchLabels": group}}]}]


def _planner_rule(spec: ModelSpec, role: str, cfg: OperatorConfig) -> list[dict[str, Any]]:
    """The operator's pods to a worker's serving port, where the planner scrapes /metrics (planner_loop.py), while
    the model has a planner and the operator knows its own pods (the chart tells it)."""
    peer = cfg.pod_peer
    if not spec.planned or role not in names.WORKER_ROLES or peer is None:
        return []
    return [{"ports": [{"protocol": "TCP", "port": names.HTTP_PORT}], "from": [peer]}]


def build_network_policies(spec: ModelSpec, cfg: OperatorConfig = DEFAULT_CFG) -> list[dict[str, Any]]:
    """One per role, and the kvstore pod's when the model has a store."""
    store = spec.kv_cache is not None and spec.kv_cache.store is not None
    return [build_network_policy(spec, role, cfg) for role in names.ROLES + ((names.KVSTORE,) if store else ())]
