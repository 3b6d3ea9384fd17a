"""Pure functions from a DisaggregatedModel to the manifests of its children."""

from collections.abc import Mapping
from typing import Any

from .. import names
from ..config import OperatorConfig
from ..spec import ModelSpec
from .policy import build_bootstrap_service, build_network_policies, build_pdb
from .router import build_router_deployment, build_router_service, router_endpoint
from .scaler import build_role_scaler, scaler_name
from .secret import build_auth_secret, new_token
from .workers import (
    build_headless_service,
    build_worker_statefulset,
    pairing_revision,
    template_hash,
    worker_args,
    worker_pod_template,
)

__all__ = [
    "build_children",
    "build_auth_secret",
    "build_role_scaler",
    "build_worker_statefulset",
    "new_token",
    "pairing_revision",
    "router_endpoint",
    "scaler_name",
    "template_hash",
    "worker_args",
    "worker_pod_template",
]


def build_children(
    spec: ModelSpec, cfg: OperatorConfig, partitions: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """Every child the operator applies on each reconcile, Services before the workloads that use them.

    `partitions` are the worker StatefulSets' rollout partitions (rollout.py decides them; 0 when absent).
    The auth Secret and the RoleScaler are not here: they are created once (`build_auth_secret`,
    `build_role_scaler`) so the token never changes and the scaler's replicas stay its scaler's.
    """
    partitions = partitions or {}
    children: list[dict[str, Any]] = []
    for role in names.WORKER_ROLES:
        children.append(build_headless_service(spec, role))
    children.append(build_bootstrap_service(spec))
    children.append(build_router_service(spec))
    for role in names.WORKER_ROLES:
        children.append(build_worker_statefulset(spec, role, cfg, partitions.get(role, 0)))
    children.append(build_router_deployment(spec, cfg))
    children += [build_pdb(spec, role) for role in names.ROLES]
    children += build_network_policies(spec)
    return children
