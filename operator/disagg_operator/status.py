"""Status as a pure function of the spec and the observed children.

`compute_status` turns what the StatefulSets, the router Deployment and the pods report into per-role counts and
the Ready, Progressing and Degraded conditions. A condition's lastTransitionTime moves only when its status does;
`transitions` lists those moves, one Event each.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import names
from .spec import ModelSpec

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
    """What a role's workload reports. `current` is False until its controller saw the latest spec."""

    replicas: int = 0
    ready: int = 0
    updated: int = 0
    current: bool = True


@dataclass(frozen=True)
class PodProblem:
    pod: str
    role: str
    reason: str


@dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str


def observe_workload(obj: Mapping[str, Any]) -> RoleObservation:
    """Counts from a StatefulSet's or Deployment's status."""
    st = obj.get("status") or {}
    generation = obj.get("metadata", {}).get("generation", 0)
    return RoleObservation(
        replicas=st.get("replicas", 0),
        ready=st.get("readyReplicas", 0),
        updated=st.get("updatedReplicas", 0),
        current=st.get("observedGeneration", 0) >= generation,
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


def latch_problems(
    latched: Mapping[str, PodProblem], current: Iterable[PodProblem], settled: set[str]
) -> dict[str, PodProblem]:
    """Problems to report: a pod's failure stays reported until its role is whole again, so a failed pod that
    the StatefulSet replaces keeps the CR Degraded until the replacement is ready."""
    out = {p.pod: p for p in current}
    for pod, problem in latched.items():
        if pod not in out and problem.role not in settled:
            out[pod] = problem
    return out


def settled_roles(spec: ModelSpec, observed: Mapping[str, RoleObservation | None]) -> set[str]:
    return {r for r in names.ROLES if _settled(spec, r, observed.get(r))}


def selector(spec: ModelSpec, role: str) -> str:
    return f"{names.MODEL_LABEL}={spec.name},{names.ROLE_LABEL}={role}"


def role_status(spec: ModelSpec, role: str, obs: RoleObservation | None) -> dict[str, Any]:
    obs = obs or RoleObservation()
    desired = spec.replicas(role)
    return {
        "replicas": obs.replicas,
        "readyReplicas": obs.ready,
        "updatedReplicas": obs.updated,
        "ready": f"{obs.ready}/{desired}",
        "selector": selector(spec, role),
    }


def _settled(spec: ModelSpec, role: str, obs: RoleObservation | None) -> bool:
    desired = spec.replicas(role)
    return (
        obs is not None and obs.current and obs.replicas == desired and obs.ready == desired and obs.updated == desired
    )


def _counts(spec: ModelSpec, observed: Mapping[str, RoleObservation | None]) -> str:
    return ", ".join(f"{r} {(observed.get(r) or RoleObservation()).ready}/{spec.replicas(r)}" for r in names.ROLES)


def _condition(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message}


def desired_conditions(
    spec: ModelSpec, observed: Mapping[str, RoleObservation | None], problems: list[PodProblem], errors: list[str]
) -> list[dict[str, Any]]:
    """Ready, Progressing and Degraded, without timestamps. `errors` are spec or apply failures."""
    counts = _counts(spec, observed)
    pending = [r for r in names.ROLES if not _settled(spec, r, observed.get(r))]
    zero = [r for r in names.ROLES if spec.replicas(r) == 0]
    if errors:
        ready = _condition(names.READY, False, "ReconcileFailed", "; ".join(errors))
    elif zero:
        ready = _condition(
            names.READY, False, "ScaledToZero", f"{', '.join(zero)} has 0 replicas: requests cannot be served"
        )
    elif pending:
        ready = _condition(names.READY, False, "ReplicasNotReady", f"ready: {counts}")
    else:
        ready = _condition(names.READY, True, "AllReplicasReady", f"ready: {counts}")
    progressing = (
        _condition(names.PROGRESSING, True, "RollingOut", f"waiting for {', '.join(pending)}: {counts}")
        if pending and not errors
        else _condition(
            names.PROGRESSING,
            False,
            "Blocked" if errors else "Complete",
            "see Degraded" if errors else "every role has its desired replicas",
        )
    )
    if errors:
        degraded = _condition(names.DEGRADED, True, "ReconcileFailed", "; ".join(errors))
    elif problems:
        msg = "; ".join(f"{p.role} pod {p.pod}: {p.reason}" for p in problems)
        degraded = _condition(names.DEGRADED, True, "PodFailing", msg)
    else:
        degraded = _condition(names.DEGRADED, False, "AsExpected", "no failing pods")
    return [ready, progressing, degraded]


def with_times(
    new: list[dict[str, Any]], previous: list[dict[str, Any]], generation: int, now: str
) -> list[dict[str, Any]]:
    """Stamp conditions: keep the previous lastTransitionTime unless the status changed."""
    before = {c.get("type"): c for c in previous}
    out = []
    for c in new:
        old = before.get(c["type"])
        changed = old is None or old.get("status") != c["status"]
        out.append(
            {
                **c,
                "observedGeneration": generation,
                "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
            }
        )
    return out


def compute_status(
    spec: ModelSpec,
    generation: int,
    observed: Mapping[str, RoleObservation | None],
    problems: list[PodProblem],
    errors: list[str],
    previous: Mapping[str, Any],
    endpoint: str,
    now: str,
) -> dict[str, Any]:
    """The full `.status` the CR should have."""
    conds = desired_conditions(spec, observed, problems, errors)
    return {
        "observedGeneration": generation,
        "endpoint": endpoint,
        **{role: role_status(spec, role, observed.get(role)) for role in names.ROLES},
        "conditions": with_times(conds, list(previous.get("conditions") or []), generation, now),
    }


def status_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """True when writing `new` would change what `kubectl get -o yaml` shows."""
    return any(old.get(k) != v for k, v in new.items())


def transitions(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[Event]:
    """One Event per condition whose status changed (a condition seen for the first time counts).

    Becoming Degraded, or losing Ready, is a Warning; everything else is Normal.
    """
    before = {c.get("type"): c.get("status") for c in previous}
    events = []
    for c in current:
        old = before.get(c["type"])
        if old == c["status"]:
            continue
        degraded = c["type"] == names.DEGRADED and c["status"] == "True"
        lost_ready = c["type"] == names.READY and old == "True"
        kind = "Warning" if degraded or lost_ready else "Normal"
        events.append(Event(kind, c["reason"], f"{c['type']}={c['status']}: {c['message']}"))
    return events
