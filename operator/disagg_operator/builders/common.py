"""Pieces every child manifest shares: labels, metadata with the owner reference, pod security, env."""

from typing import Any

from .. import names
from ..config import OperatorConfig
from ..spec import ModelSpec


def selector_labels(spec: ModelSpec, role: str) -> dict[str, str]:
    """Labels that select one role's pods of one CR (immutable once a StatefulSet exists)."""
    return {names.MODEL_LABEL: spec.name, names.ROLE_LABEL: role}


def front_end_labels(spec: ModelSpec, role: str) -> dict[str, str]:
    """The pods of a role that serve HTTP (and bootstrap): all of them, or the leaders of groups that span nodes."""
    leaders = {names.LWS_WORKER_INDEX_LABEL: "0"} if role != names.ROUTER and spec.worker(role).nodes > 1 else {}
    return {**selector_labels(spec, role), **leaders}


def labels(spec: ModelSpec, component: str) -> dict[str, str]:
    """The CR's own labels, then the operator's (which win on a clash)."""
    return {
        **spec.labels,
        names.LABEL_NAME: names.APP_NAME,
        names.LABEL_INSTANCE: spec.name,
        names.LABEL_COMPONENT: component,
        names.LABEL_PART_OF: names.APP_NAME,
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.MODEL_LABEL: spec.name,
    }


def role_labels(spec: ModelSpec, role: str) -> dict[str, str]:
    return {**labels(spec, role), **selector_labels(spec, role)}


def owner_reference(spec: ModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(spec: ModelSpec, name: str, component: str, role: str | None = None) -> dict[str, Any]:
    """Metadata of a child: its name, the CR's namespace, labels and an owner reference to the CR."""
    return {
        "name": name,
        "namespace": spec.namespace,
        "labels": role_labels(spec, role) if role else labels(spec, component),
        "ownerReferences": [owner_reference(spec)],
    }


def pod_security_context() -> dict[str, Any]:
    uid = names.WORKER_UID
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(ipc_lock: bool) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if ipc_lock:
        caps["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": caps,
    }


def base_env(spec: ModelSpec) -> list[dict[str, Any]]:
    """Downward-API identity, present in every pod (secrets are files: `secret.auth_volume`)."""
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": names.POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def probes(ready_path: str = "/health", live_path: str = "/health") -> dict[str, Any]:
    """Readiness on `ready_path`, liveness on `live_path`; a startup probe gives model loading up to ten minutes."""
    return {
        "readinessProbe": http_probe(ready_path, 5, 3),
        "livenessProbe": http_probe(live_path, 10, 6),
        "startupProbe": http_probe(live_path, 10, 60),
    }


def drain_on_stop() -> dict[str, Any]:
    """The container's preStop hook: keep serving while Services and the router drop the pod; SIGTERM follows
    and starts the process's own drain (`--drain-timeout`), which the pod's grace period leaves time for."""
    return {"lifecycle": {"preStop": {"sleep": {"seconds": names.PRESTOP_SLEEP_SECONDS}}}}


def tmp_volume(size: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A writable /tmp of at most `size`, since the root filesystem is read-only."""
    return {"name": "tmp", "emptyDir": {"sizeLimit": size}}, {"name": "tmp", "mountPath": "/tmp"}


def service_fqdn(spec: ModelSpec, service: str, cfg: OperatorConfig) -> str:
    """A Service of the model's namespace by its fully qualified name (no search-list lookups in the pods)."""
    return f"{service}.{spec.namespace}.svc.{cfg.cluster_domain}"
