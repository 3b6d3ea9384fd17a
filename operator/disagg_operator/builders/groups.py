"""A worker role whose instances span nodes (`tpSize * ppSize` above `gpusPerNode`): one LeaderWorkerSet
(sigs.k8s.io/lws) per role, a group of `nodes` pods per instance.

Pod 0 of a group (LWS's leader) runs the first share of the ranks, the HTTP front end and, on prefill, the bootstrap
server; pods 1.. run their ranks only and answer /health while those run (`server/worker_node.py`). Every pod has
the same template: LWS injects `LWS_LEADER_ADDRESS` (the leader's name in the Service LWS makes, which publishes
not-ready addresses so that the ranks meet before anyone is Ready) and `LWS_WORKER_INDEX`, which the worker's flags
take (`--node-rank`, `--dist-init-addr`).

- `RecreateGroupOnPodRestart`: ranks cannot rejoin a running instance, so a pod that restarts, is deleted or goes
  with its node takes its group down, and LWS recreates all of it.
- `LeaderCreated`: the workers start with the leader. The leader is Ready only once its ranks met (the workers'
  among them): waiting for a Ready leader (`LeaderReady`) would wait forever.
- Probes on every pod: the leader's say whether the instance serves (the router and the Services need that); a
  worker pod's liveness fails once one of its ranks ended, so the kubelet restarts it and LWS the group, even where
  the failure has not yet reached the leader; its readiness counts towards the group's.
- Rollouts go through LWS's partition (groups at or above it run the new template), which the rollout planner moves
  as it moves a StatefulSet's; each pod carries the template's hash as a label, since LWS reports no revisions.
"""

from typing import Any

from .. import names
from ..config import OperatorConfig
from ..spec import ModelSpec
from .common import metadata
from .workers import template_hash, worker_pod_template


def group_pod_template(spec: ModelSpec, role: str, cfg: OperatorConfig) -> tuple[dict[str, Any], str]:
    """The template of every pod of the role's groups, and its hash (also on the pods, as a label)."""
    template = worker_pod_template(spec, role, cfg)
    digest = template_hash(template)
    template["metadata"]["labels"][names.TEMPLATE_HASH_LABEL] = digest
    return template, digest


def build_worker_group_set(spec: ModelSpec, role: str, cfg: OperatorConfig, partition: int = 0) -> dict[str, Any]:
    w = spec.worker(role)
    template, digest = group_pod_template(spec, role, cfg)
    meta = metadata(spec, names.group_set_name(spec.name, role), role, role)
    meta["annotations"] = {names.TEMPLATE_HASH_ANNOTATION: digest}
    return {
        "apiVersion": names.LWS_API_VERSION,
        "kind": names.LWS_KIND,
        "metadata": meta,
        "spec": {
            "replicas": w.replicas,
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"partition": partition, "maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": w.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
        },
    }
