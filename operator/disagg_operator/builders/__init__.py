"""Pure functions from a DisaggregatedModel to the manifests of its children."""

from collections.abc import Mapping
from typing import Any

from .. import names
from ..config import OperatorConfig
from ..spec import ModelSpec
from .gateway import build_gateway_children, retired_gateway
from .groups import build_worker_group_set
from .kvstore import build_kvstore_deployment, build_kvstore_service, model_store, retired_kvstore
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
    "build_gateway_children",
    "build_auth_secret",
    "build_role_scaler",
    "build_worker_set",
    "build_worker_statefulset",
    "retired_children",
    "retired_gateway",
    "worker_set_name",
    "new_token",
    "pairing_revision",
    "router_endpoint",
    "scaler_name",
    "template_hash",
    "worker_args",
    "worker_pod_template",
]


def build_worker_set(
    spec: ModelSpec, role: str, cfg: OperatorConfig, partition: int = 0, surge: int = 0
) -> dict[str, Any]:
    """A worker role's workload: a StatefulSet of one pod per instance (plus `surge` pods while it rolls), or a
    LeaderWorkerSet of one group of pods per instance when an instance spans nodes (groups.py; it rolls in place)."""
    if spec.worker(role).nodes > 1:
        return build_worker_group_set(spec, role, cfg, partition)
    return build_worker_statefulset(spec, role, cfg, partition, surge)


def worker_set_name(spec: ModelSpec, role: str) -> str:
    return names.group_set_name(spec.name, role) if spec.worker(role).nodes > 1 else names.child_name(spec.name, role)


def build_children(
    spec: ModelSpec,
    cfg: OperatorConfig,
    partitions: Mapping[str, int] | None = None,
    surges: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Every child the operator applies on each reconcile, Services before the workloads that use them.

    `partitions` and `surges` are the worker StatefulSets' rollout partitions and surge pods (rollout.py decides
    them; 0 when absent).
    With `spec.kvCache.store` the store's Service and Deployment come before the workers (which connect to it).
    The auth Secret and the RoleScaler are not here: they are created once (`build_auth_secret`,
    `build_role_scaler`) so the token never changes and the scaler's replicas stay its scaler's.
    """
    partitions, surges = partitions or {}, surges or {}
    store = model_store(spec)
    children: list[dict[str, Any]] = []
    for role in names.WORKER_ROLES:
        children.append(build_headless_service(spec, role))
    children.append(build_bootstrap_service(spec))
    children.append(build_router_service(spec))
    if store is not None:
        children.append(build_kvstore_service(spec))
        children.append(build_kvstore_deployment(spec, store))
    for role in names.WORKER_ROLES:
        children.append(build_worker_set(spec, role, cfg, partitions.get(role, 0), surges.get(role, 0)))
    children.append(build_router_deployment(spec, cfg))
    children += [build_pdb(spec, role) for role in names.ROLES]
    children += build_network_policies(spec, cfg)
    return children


def retired_children(spec: ModelSpec) -> list[dict[str, Any]]:
    """Children a change of the spec retired (the store's, when `spec.kvCache.store` went): each deleted if this
    model made it. Only their apiVersion, kind and metadata.name are set."""
    return retired_kvstore(spec)
