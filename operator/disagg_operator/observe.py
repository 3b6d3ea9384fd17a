"""What the operator observes of a DisaggregatedModel's children: workload counts and rollout state, pods, and
pods that are failing. Pure functions of one object each, called from the watch indexes."""

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import names

FAILING_WAIT_REASONS = {
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "InvalidImageName",
    "RunContainerError",
}


@dataclass(frozen=True)
class RoleObservation:
    """What a role's workload reports. `current` is False until its controller saw the latest spec.

    For a StatefulSet also its rollout state: the partition, the template hash the operator last applied, and the
    controller's current and update revisions (equal once every pod runs the latest template).
    """

    replicas: int = 0
    ready: int = 0
    updated: int = 0
    current: bool = True
    partition: int = 0
    template_hash: str = ""
    current_revision: str = ""
    update_revision: str = ""
    desired: int | None = None  # the replicas its spec asks for (`replicas` counts the pods that exist)


@dataclass(frozen=True)
class PodInfo:
    """One pod of a model, as the rollout planner and the router prober need it."""

    name: str
    role: str
    ip: str = ""
    ready_since: float | None = None  # epoch seconds of the Ready condition's transition; None when not Ready
    revision: str = ""  # the StatefulSet's controller-revision-hash
    terminating: bool = False
    unschedulable_since: float | None = None  # epoch seconds since the scheduler found no node for it
    owner_kind: str = ""  # the kind and uid of its controlling owner reference ("" when it has none)
    owner_uid: str = ""

    def available(self, now: float, min_ready_s: float) -> bool:
        return self.ready_since is not None and not self.terminating and now - self.ready_since >= min_ready_s


@dataclass(frozen=True)
class OwnerLink:
    """One ReplicaSet or Deployment: its uid, kind and name, and the uid of its controlling owner ("" when none).
    The links lead from a router pod to the Deployment that created it, and on to the model (router_trust.py)."""

    uid: str
    kind: str
    name: str
    owner_uid: str = ""


@dataclass(frozen=True)
class PodProblem:
    pod: str
    role: str
    reason: str


def observe_workload(obj: Mapping[str, Any]) -> RoleObservation:
    """Counts from a StatefulSet's or Deployment's status."""
    st = obj.get("status") or {}
    meta = obj.get("metadata", {})
    rolling = ((obj.get("spec") or {}).get("updateStrategy") or {}).get("rollingUpdate") or {}
    return RoleObservation(
        replicas=st.get("replicas", 0),
        ready=st.get("readyReplicas", 0),
        desired=int((obj.get("spec") or {}).get("replicas", 1)),
        updated=st.get("updatedReplicas", 0),
        current=st.get("observedGeneration", 0) >= meta.get("generation", 0),
        partition=int(rolling.get("partition", 0)),
        template_hash=(meta.get("annotations") or {}).get(names.TEMPLATE_HASH_ANNOTATION, ""),
        current_revision=st.get("currentRevision", ""),
        update_revision=st.get("updateRevision", ""),
    )


def observe_group_set(obj: Mapping[str, Any]) -> RoleObservation:
    """Counts (of groups) from a LeaderWorkerSet's status, and its rollout partition. LWS reports no revisions and
    no observed generation: the rollout planner reads the pods' template-hash labels instead (rollout.py)."""
    st, meta = obj.get("status") or {}, obj.get("metadata", {})
    rolling = ((obj.get("spec") or {}).get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
    digest = (meta.get("annotations") or {}).get(names.TEMPLATE_HASH_ANNOTATION, "")
    return RoleObservation(
        replicas=st.get("replicas", 0),
        ready=st.get("readyReplicas", 0),
        updated=st.get("updatedReplicas", 0),
        partition=int(rolling.get("partition", 0)),
        template_hash=digest,
        update_revision=digest,
    )


def parse_time(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def controller_of(meta: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, uid) of an object's controlling owner reference; ("", "") when it has none."""
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return str(ref.get("kind", "")), str(ref.get("uid", ""))
    return "", ""


def observe_link(obj: Mapping[str, Any]) -> OwnerLink:
    meta = obj.get("metadata") or {}
    return OwnerLink(
        str(meta.get("uid", "")), str(obj.get("kind", "")), str(meta.get("name", "")), controller_of(meta)[1]
    )


def observe_pod(pod: Mapping[str, Any]) -> PodInfo:
    meta, st = pod.get("metadata", {}), pod.get("status") or {}
    labels = meta.get("labels") or {}
    ready: Mapping[str, Any] = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), {})
    scheduled: Mapping[str, Any] = next((c for c in st.get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    owner_kind, owner_uid = controller_of(meta)
    return PodInfo(
        name=meta.get("name", ""),
        role=labels.get(names.ROLE_LABEL, ""),
        ip=st.get("podIP", ""),
        ready_since=parse_time(ready.get("lastTransitionTime") or "1970-01-01T00:00:00Z")
        if ready.get("status") == "True"
        else None,
        # A group pod's template hash (builders/groups.py), else its StatefulSet's revision.
        revision=labels.get(names.TEMPLATE_HASH_LABEL) or labels.get(names.CONTROLLER_REVISION_LABEL, ""),
        terminating=bool(meta.get("deletionTimestamp")),
        unschedulable_since=parse_time(scheduled.get("lastTransitionTime"))
        if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
        else None,
        owner_kind=owner_kind,
        owner_uid=owner_uid,
    )


def pod_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """Why a pod is failing, or None when it is fine or merely starting."""
    meta, st = pod.get("metadata", {}), pod.get("status") or {}
    role = meta.get("labels", {}).get(names.ROLE_LABEL, "")
    if st.get("phase") == "Failed":
        reason = st.get("reason") or _terminated_reason(st) or "pod failed"
        return PodProblem(meta.get("name", ""), role, reason)
    if meta.get("deletionTimestamp"):
        return None  # a pod shutting down normally (scale-down, rollout) exits non-zero too
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            return PodProblem(meta.get("name", ""), role, f"unschedulable: {cond.get('message', '')}".strip())
    for cs in st.get("containerStatuses") or []:
        state = cs.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason") in FAILING_WAIT_REASONS:
            return PodProblem(meta.get("name", ""), role, f"container {cs.get('name')}: {waiting['reason']}")
        if terminated and terminated.get("exitCode", 0) != 0:
            reason = terminated.get("reason") or "Error"
            return PodProblem(
                meta.get("name", ""), role, f"container {cs.get('name')}: {reason} (exit code {terminated['exitCode']})"
            )
    return None


def _terminated_reason(st: Mapping[str, Any]) -> str | None:
    for cs in st.get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if terminated.get("exitCode", 0) != 0:
            return (
                f"container {cs.get('name')}: {terminated.get('reason') or 'Error'} "
                f"(exit code {terminated['exitCode']})"
            )
    return None
