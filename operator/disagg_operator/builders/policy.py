"""Objects that protect the pods: the bootstrap Service, PodDisruptionBudgets and the transfer NetworkPolicy."""

from typing import Any

from .. import names
from ..spec import ModelSpec
from .common import metadata, selector_labels


def build_bootstrap_service(spec: ModelSpec) -> dict[str, Any]:
    """A ClusterIP Service in front of the prefill pods' bootstrap servers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, names.bootstrap_service_name(spec.name), "bootstrap", names.PREFILL),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec, names.PREFILL),
            "ports": [
                {"name": "bootstrap", "port": names.BOOTSTRAP_PORT, "targetPort": "bootstrap", "protocol": "TCP"}
            ],
        },
    }


def build_pdb(spec: ModelSpec, role: str) -> dict[str, Any]:
    """At most one pod of a role is evicted at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(spec, names.child_name(spec.name, role), role, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(spec, role)}},
    }


def _model_pods(spec: ModelSpec, roles: tuple[str, ...]) -> dict[str, Any]:
    return {
        "podSelector": {
            "matchLabels": {names.MODEL_LABEL: spec.name},
            "matchExpressions": [{"key": names.ROLE_LABEL, "operator": "In", "values": list(roles)}],
        }
    }


def build_network_policy(spec: ModelSpec) -> dict[str, Any]:
    """Workers accept HTTP from anywhere, but bootstrap only from this CR's pods and the transfer port range
    only from this CR's prefill and decode pods: the transfer engine has no authentication of its own."""
    workers = _model_pods(spec, names.WORKER_ROLES)
    everyone_of_cr = _model_pods(spec, names.ROLES)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(spec, names.network_policy_name(spec.name), "transfer"),
        "spec": {
            "podSelector": workers["podSelector"],
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": names.HTTP_PORT}]},
                {"from": [everyone_of_cr], "ports": [{"protocol": "TCP", "port": names.BOOTSTRAP_PORT}]},
                {
                    "from": [workers],
                    "ports": [{"protocol": "TCP", "port": names.TRANSFER_PORT_MIN, "endPort": names.TRANSFER_PORT_MAX}],
                },
            ],
        },
    }
