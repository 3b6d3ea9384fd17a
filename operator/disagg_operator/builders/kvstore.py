"""The KV tiers under the workers' prefix caches (`spec.kvCache`): the workers' flags, and Mooncake Store's pod.

Every prefill and decode worker keeps a host-memory tier (`--enable-hierarchical-cache`). With `spec.kvCache.store`
the operator also runs the model's Mooncake Store: a Deployment `<model>-kvstore` of one pod with two containers,
`mooncake_master` (the store's RPC on 50051 and its HTTP metadata service on 8080; no etcd, no HA) and
`mooncake_client`, which holds the store's whole memory as one segment (`store.memory`). Workers mount no segment
of their own: their pages live in the store pod, so they outlast any worker's restart and every rollout. The
client's transfer engine listens in a fixed window (`MC_MIN_RPC_PORT..MC_MAX_RPC_PORT`), which the pod's
NetworkPolicy opens to this model's workers with the master's two ports (builders/ports.py), and nothing else.
"""

from typing import Any

from disagg_api import tier_settings as T
from disagg_api.setting import Setting

from .. import names
from ..kvcache import StoreSpec
from ..quantity import mebibytes, to_bytes
from ..spec import ModelSpec
from .common import container_security_context, metadata, pod_security_context, role_labels, selector_labels, tmp_volume

# Each container's memory beyond what it holds: mooncake_master keeps the keys' metadata (about 60 MiB idle),
# mooncake_client the transfer engine's threads and buffers on top of its segment (about 60 MiB idle, measured
# with Mooncake 0.3.13). The client's memory request and limit are `store.memory` plus this; the master's are this.
STORE_OVERHEAD = "512Mi"
STORE_TMP = "256Mi"  # glog's files, should either process write any
STORE_LOGS = "512Mi"  # each container's log and writable layer, counted as ephemeral storage


def model_store(spec: ModelSpec) -> StoreSpec | None:
    return spec.kv_cache.store if spec.kv_cache is not None else None


def kvstore_name(spec: ModelSpec) -> str:
    return names.child_name(spec.name, names.KVSTORE)


def store_master(spec: ModelSpec) -> str:
    """Where workers reach mooncake_master: the store's Service, by name."""
    return f"{kvstore_name(spec)}.{spec.namespace}.svc:{names.KVSTORE_RPC_PORT}"


def store_metadata_server(spec: ModelSpec) -> str:
    return f"http://{kvstore_name(spec)}.{spec.namespace}.svc:{names.KVSTORE_METADATA_PORT}/metadata"


def tier_settings(spec: ModelSpec, role: str) -> list[tuple[Setting, Any]]:
    """A worker's KV tier flags: none without `spec.kvCache` (no pod rolls for the feature), the host tier's with
    it, and the store's address and prefetch settings with `spec.kvCache.store`."""
    kv = spec.kv_cache
    if kv is None:
        return []
    host = kv.host(role)
    out: list[tuple[Setting, Any]] = [(T.ENABLE_HIERARCHICAL_CACHE, True)]
    out.append((T.HICACHE_SIZE, host.size_gb) if host.size_gb is not None else (T.HICACHE_RATIO, host.ratio))
    out.append((T.HICACHE_WRITE_POLICY, kv.write_policy))
    if kv.store is not None:
        out += [
            (T.HICACHE_STORAGE_BACKEND, "mooncake"),
            (T.HICACHE_STORAGE_PREFETCH_POLICY, kv.store.prefetch_policy),
            (T.HICACHE_STORAGE_PREFETCH_TIMEOUT, kv.store.prefetch_timeout_s),
            (T.HICACHE_STORE_MASTER, store_master(spec)),
            (T.HICACHE_STORE_METADATA_SERVER, store_metadata_server(spec)),
        ]
    return out


def with_host_tier(spec: ModelSpec, role: str, quantities: dict[str, Any]) -> dict[str, Any]:
    """A worker's memory request or limit, where the CR sets one, plus its host tier's `hostSize`: the tier is
    memory of the worker's own process. With `hostRatio` nothing is added: the tier's bytes follow the model's KV
    size, which the operator does not know (the CR's memory must include them). A quantity not written as
    digits and a suffix (Ki, Mi, Gi, ... or k, M, G, ...) is left as written."""
    extra = spec.kv_cache.host(role).size_bytes if spec.kv_cache is not None else None
    if not extra or "memory" not in quantities:
        return quantities
    try:
        return {**quantities, "memory": mebibytes(to_bytes(str(quantities["memory"])) + extra)}
    except ValueError:
        return quantities


def _resources(memory_bytes: int, cpu: str) -> dict[str, Any]:
    memory = mebibytes(memory_bytes)
    storage = STORE_LOGS
    return {
        "requests": {"cpu": cpu, "memory": memory, "ephemeral-storage": storage},
        "limits": {"memory": memory, "ephemeral-storage": storage},
    }


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def master_container(spec: ModelSpec, mount: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "master",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mooncake_master"],
        "args": [
            f"-rpc_port={names.KVSTORE_RPC_PORT}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=0.0.0.0",
            f"-http_metadata_server_port={names.KVSTORE_METADATA_PORT}",
            f"-metrics_port={names.KVSTORE_ADMIN_PORT}",
        ],
        "ports": [
            _port("rpc", names.KVSTORE_RPC_PORT),
            _port("metadata", names.KVSTORE_METADATA_PORT),
            _port("admin", names.KVSTORE_ADMIN_PORT),
        ],
        "resources": _resources(to_bytes(STORE_OVERHEAD), "100m"),
        "securityContext": container_security_context(ipc_lock=False),
        "volumeMounts": [mount],
        # The admin server's /health says the master serves; its RPC port accepting connections keeps it alive.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "admin"}, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 10, "failureThreshold": 6},
    }


def client_container(spec: ModelSpec, store: StoreSpec, mount: dict[str, Any]) -> dict[str, Any]:
    first, last = names.KVSTORE_TRANSFER_PORTS
    local = f"127.0.0.1:{names.KVSTORE_RPC_PORT}"
    return {
        "name": "store",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mooncake_client"],
        "args": [
            f"-global_segment_size={store.memory_bytes}",
            f"-master_server_address={local}",
            f"-metadata_server=http://127.0.0.1:{names.KVSTORE_METADATA_PORT}/metadata",
            "-host=$(POD_IP)",
            "-protocol=tcp",
            "-enable_http_server=true",
            f"-http_port={names.KVSTORE_CLIENT_HTTP_PORT}",
        ],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "MC_MIN_RPC_PORT", "value": str(first)},
            {"name": "MC_MAX_RPC_PORT", "value": str(last)},
        ],
        "ports": [_port("health", names.KVSTORE_CLIENT_HTTP_PORT)],  # the transfer engine takes any of the window
        "resources": _resources(store.memory_bytes + to_bytes(STORE_OVERHEAD), "250m"),
        "securityContext": container_security_context(ipc_lock=False),
        "volumeMounts": [mount],
        # Ready once its segment is mounted in the master and its HTTP server answers; alive while that listens.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "health"}, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": "health"}, "periodSeconds": 10, "failureThreshold": 6},
    }


def build_kvstore_deployment(spec: ModelSpec, store: StoreSpec) -> dict[str, Any]:
    """One pod, replaced (not surged) on a change: two stores would split the workers, and a second segment
    would double the memory while both run."""
    tmp_vol, tmp_mount = tmp_volume(STORE_TMP)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(spec, kvstore_name(spec), names.KVSTORE, names.KVSTORE),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(spec, names.KVSTORE)},
            "template": {
                "metadata": {"labels": role_labels(spec, names.KVSTORE)},
                "spec": {
                    "containers": [
                        master_container(spec, tmp_mount),
                        client_container(spec, store, tmp_mount),
                    ],
                    "volumes": [tmp_vol],
                    "securityContext": pod_security_context(),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                },
            },
        },
    }


def build_kvstore_service(spec: ModelSpec) -> dict[str, Any]:
    """The master's RPC and metadata service by a stable name (the transfer engine is reached at the pod's IP,
    which the metadata service publishes)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, kvstore_name(spec), names.KVSTORE, names.KVSTORE),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec, names.KVSTORE),
            "ports": [
                {"name": "rpc", "port": names.KVSTORE_RPC_PORT, "targetPort": "rpc", "protocol": "TCP"},
                {"name": "metadata", "port": names.KVSTORE_METADATA_PORT, "targetPort": "metadata", "protocol": "TCP"},
            ],
        },
    }


def retired_kvstore(spec: ModelSpec) -> list[dict[str, Any]]:
    """The store's children that must not exist (the model has no store): what the operator deletes, if it made
    them. The NetworkPolicy is named like the Deployment and the Service."""
    if model_store(spec) is not None:
        return []
    meta = {"name": kvstore_name(spec), "namespace": spec.namespace}
    kinds = [("apps/v1", "Deployment"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy")]
    return [{"apiVersion": v, "kind": k, "metadata": dict(meta)} for v, k in kinds]
