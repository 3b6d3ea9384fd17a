"""Pure functions from a DisaggregatedModel to the manifests of its children."""

from typing import Any

from .. import names
from ..config import OperatorConfig
from ..spec import ModelSpec
from .policy import build_bootstrap_service, build_network_policies, build_pdb
from .router import build_router_deployment, build_router_service, router_endpoint
from .secret import build_auth_secret, new_token
from .workers import build_headless_service, build_worker_statefulset, worker_args

__all__ = ["build_children", "build_auth_secret", "new_token", "router_endpoint", "worker_args"]


def build_children(spec: ModelSpec, cfg: OperatorConfig) -> list[dict[str, Any]]:
    """Every child the operator applies on each reconcile, Services before the workloads that use them.

    The auth Secret is not here: it is created once (see `build_auth_secret`) so its token never changes.
    """
    children: list[dict[str, Any]] = []
    for role in names.WORKER_ROLES:
        children.append(build_headless_service(spec, role))
    children.append(build_bootstrap_service(spec))
    children.append(build_router_service(spec))
    for role in names.WORKER_ROLES:
        children.append(build_worker_statefulset(spec, role, cfg))
    children.append(build_router_deployment(spec, cfg))
    children += [build_pdb(spec, role) for role in names.ROLES]
    children += build_network_policies(spec)
    return children
