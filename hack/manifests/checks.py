"""Checks kube-score lacks, in the spirit of kube-linter's (whose module cannot be fetched here): findings about
disruption and local storage that an admin sends back. Each returns (Kind/name, summary) pairs."""

from collections.abc import Callable, Iterator
from typing import Any

HOSTNAME = "kubernetes.io/hostname"
Check = Callable[[dict[str, Any]], Iterator[str]]


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return obj["spec"] if obj.get("kind") == "Pod" else None


def pdb_unhealthy_pod_eviction_policy(obj: dict[str, Any]) -> Iterator[str]:
    """kube-linter's check of the same name: an unready pod must not block a node drain."""
    if obj.get("kind") == "PodDisruptionBudget" and obj["spec"].get("unhealthyPodEvictionPolicy") != "AlwaysAllow":
        yield "unhealthyPodEvictionPolicy is not AlwaysAllow: a drain waits on pods that are not Ready"


def emptydir_size_limit(obj: dict[str, Any]) -> Iterator[str]:
    """Every emptyDir is bounded, so one pod's disk (or memory) use cannot evict its neighbours."""
    for volume in (_pod_spec(obj) or {}).get("volumes", []):
        if "emptyDir" in volume and "sizeLimit" not in (volume["emptyDir"] or {}):
            yield f"emptyDir {volume['name']} has no sizeLimit"


def replicas_spread_over_nodes(obj: dict[str, Any]) -> Iterator[str]:
    """Replicas of a workload are spread over nodes, by a podAntiAffinity or a topology spread on the node name."""
    pod = _pod_spec(obj)
    if pod is None or obj["kind"] not in ("Deployment", "StatefulSet") or obj["spec"].get("replicas", 1) < 2:
        return
    anti = (pod.get("affinity") or {}).get("podAntiAffinity") or {}
    terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", []) + [
        t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])
    ]
    keys = {t.get("topologyKey") for t in terms} | {c["topologyKey"] for c in pod.get("topologySpreadConstraints", [])}
    if HOSTNAME not in keys:
        yield "replicas may all land on one node: no podAntiAffinity or topology spread on kubernetes.io/hostname"


CHECKS: dict[str, Check] = {
    "pdb-unhealthy-pod-eviction-policy": pdb_unhealthy_pod_eviction_policy,
    "emptydir-size-limit": emptydir_size_limit,
    "replicas-spread-over-nodes": replicas_spread_over_nodes,
}


def run(docs: list[dict[str, Any]]) -> Iterator[tuple[str, str, str]]:
    """(check id, Kind/name, summary) for every finding in `docs`."""
    for obj in docs:
        for check_id, check in CHECKS.items():
            for summary in check(obj):
                yield check_id, f"{obj['kind']}/{obj['metadata']['name']}", summary
