"""The prefill RoleScaler: a small object whose scale subresource an HPA or `kubectl scale` can drive."""

from typing import Any

from .. import names
from ..spec import ModelSpec
from .common import metadata


def scaler_name(spec: ModelSpec, role: str) -> str:
    return names.child_name(spec.name, role)


def build_role_scaler(spec: ModelSpec, role: str) -> dict[str, Any]:
    """Created once with the role's current replicas; afterwards its spec.replicas belongs to whoever scales it
    (see scaling.py for how it and the DisaggregatedModel stay in step)."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.SCALER_KIND,
        "metadata": metadata(spec, scaler_name(spec, role), role, role),
        "spec": {"model": spec.name, "role": role, "replicas": spec.replicas(role)},
    }
