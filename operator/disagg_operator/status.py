"""Status as a pure function of the spec and the observed children.

`compute_status` turns what the StatefulSets, the router Deployment and the pods report into per-role counts and
the Ready, Progressing and Degraded conditions. A condition's lastTransitionTime moves only when its status does;
`transitions` lists those moves, one Event each.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import names
from .builders.epp import epp_endpoint
from .builders.gateway import build_http_route, pool_name
from .builders.kvstore import model_store, store_master
from .observe import PodProblem, RoleObservation, observe_workload, pod_problem
from .rollout import RolloutPlan, progressing_condition, rollout_status
from .routerview import RouterView, handoff_condition, missing_adapters, pairing_condition, transfer_status
from .spec import ModelSpec
from .weights import cache_condition

__all__ = ["PodProblem", "RoleObservation", "compute_status", "observe_workload", "pod_problem", "transitions"]


@dataclass(frozen=True)
class Findings:
    """What the rollout planner and the router pods add to the children's counts."""

    rollout: RolloutPlan | None = None
    revision: str = ""
    router: RouterView | None = None
    gateway: tuple[str, ...] = ()  # why the gateway's children could not be applied (gateway_step.py)


GATEWAY_UNAVAILABLE = "GatewayUnavailable"  # Degraded's reason (and the Event's) when only the gateway fails
# The state of each condition a user should hear about through an Event (the others are news only on change).
BAD = {names.PAIRING_VERIFIED: "False", names.HANDOFF_STALLED: "True", names.WEIGHTS_CACHE_AT_RISK: "True"}


@dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str


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
    """The roles whose pods are all there, ready and current (the kvstore's too, or it has none)."""
    store = observed.get(names.KVSTORE)
    whole = model_store(spec) is None or (store is not None and store.current and store.ready >= 1)
    return {r for r in names.ROLES if _settled(spec, r, observed.get(r))} | ({names.KVSTORE} if whole else set())


def kvstore_status(spec: ModelSpec, obs: RoleObservation | None) -> dict[str, Any] | None:
    """The store's pod as its Deployment counts it, and where workers reach it; None (removed) without a store.
    Ready does not wait for it: workers serve without the store, computing again what it would have held."""
    if model_store(spec) is None:
        return None
    obs = obs or RoleObservation()
    return {"readyReplicas": obs.ready, "ready": f"{obs.ready}/1", "master": store_master(spec)}


def gateway_status(spec: ModelSpec, obs: RoleObservation | None) -> dict[str, Any] | None:
    """The InferencePool a gateway routes to, its endpoint picker and whether the picker's pods are ready (a ready
    picker has a healthy decode pod to pick); None (removed) without `spec.gateway`."""
    if spec.gateway is None:
        return None
    obs = obs or RoleObservation()
    out = {
        "pool": pool_name(spec),
        "endpointPicker": epp_endpoint(spec),
        "readyReplicas": obs.ready,
        "ready": f"{obs.ready}/{spec.gateway.replicas}",
    }
    route = build_http_route(spec, spec.gateway)
    return {**out, "httpRoute": route["metadata"]["name"]} if route else out


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


def _condition(ctype: str, ok: bool | str, reason: str, message: str) -> dict[str, Any]:
    status = ok if isinstance(ok, str) else ("True" if ok else "False")
    return {"type": ctype, "status": status, "reason": reason, "message": message}


def _progressing(
    pending: list[str], counts: str, errors: list[str], rollout: tuple[bool, str, str] | None
) -> dict[str, Any]:
    if errors:
        return _condition(names.PROGRESSING, False, "Blocked", "see Degraded")
    if rollout:
        return _condition(names.PROGRESSING, *rollout)
    if pending:
        return _condition(names.PROGRESSING, True, "RollingOut", f"waiting for {', '.join(pending)}: {counts}")
    return _condition(names.PROGRESSING, False, "Complete", "every role has its desired replicas")


def desired_conditions(
    spec: ModelSpec,
    observed: Mapping[str, RoleObservation | None],
    problems: list[PodProblem],
    errors: list[str],
    pairing: tuple[str, str, str] = ("True", "", ""),
    rollout: tuple[bool, str, str] | None = None,
    gateway: tuple[str, ...] = (),
    unserved: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Ready, Progressing and Degraded, without timestamps. `errors` are spec or apply failures; `pairing` is
    PairingVerified (Ready requires it) and `rollout` the Progressing of a rollout in progress. `gateway`'s
    failures make the model Degraded but neither block nor un-Ready it: its router serves all the same.
    `unserved`: the LoRA adapters of `spec.lora` no healthy pair serves (Ready waits for them)."""
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
    elif pairing[0] != "True":
        ready = _condition(names.READY, False, "PairingNotVerified", f"{pairing[1]}: {pairing[2]}")
    elif unserved:
        ready = _condition(
            names.READY,
            False,
            "AdaptersNotServed",
            f"no healthy prefill and decode pair serves LoRA adapter {', '.join(unserved)} yet",
        )
    else:
        ready = _condition(names.READY, True, "AllReplicasReady", f"ready: {counts}")
    progressing = _progressing(pending, counts, errors, rollout)
    if errors:
        degraded = _condition(names.DEGRADED, True, "ReconcileFailed", "; ".join(errors))
    elif problems:
        msg = "; ".join([f"{p.role} pod {p.pod}: {p.reason}" for p in problems] + list(gateway))
        degraded = _condition(names.DEGRADED, True, "PodFailing", msg)
    elif gateway:
        degraded = _condition(names.DEGRADED, True, GATEWAY_UNAVAILABLE, "; ".join(gateway))
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
        stamp = now if old is None or old.get("status") != c["status"] else old.get("lastTransitionTime", now)
        out.append({**c, "observedGeneration": generation, "lastTransitionTime": stamp})
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
    findings: Findings = Findings(),
) -> dict[str, Any]:
    """The full `.status` the CR should have. `rollout`, `transfer` and `kvStore` are None (removed) when there is
    nothing to say; the merge patch that writes the status deletes a field set to None."""
    plan, view = findings.rollout, findings.router
    rollout = rollout_status(plan, findings.revision, previous.get("rollout"), now) if plan else None
    pairing = pairing_condition(spec, observed.get(names.ROUTER), view)
    progress = progressing_condition(spec, plan, rollout, now) if plan else None
    unserved = missing_adapters(spec, view)
    conds = desired_conditions(spec, observed, problems, errors, pairing, progress, findings.gateway, unserved)
    conds.append(_condition(names.PAIRING_VERIFIED, *pairing))
    conds.append(_condition(names.HANDOFF_STALLED, *handoff_condition(view)))
    conds.append(_condition(names.WEIGHTS_CACHE_AT_RISK, *cache_condition(spec)))
    return {
        "observedGeneration": generation,
        "endpoint": endpoint,
        **{role: role_status(spec, role, observed.get(role)) for role in names.ROLES},
        "rollout": rollout,
        "transfer": transfer_status(view),
        "kvStore": kvstore_status(spec, observed.get(names.KVSTORE)),
        "gateway": gateway_status(spec, observed.get(names.EPP)),
        "conditions": with_times(conds, list(previous.get("conditions") or []), generation, now),
    }


def status_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """True when writing `new` would change what `kubectl get -o yaml` shows."""
    return any(old.get(k) != v for k, v in new.items())


def transitions(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[Event]:
    """One Event per condition whose status changed (a condition seen for the first time counts). PairingVerified,
    HandoffStalled and WeightsCacheAtRisk speak only when they enter or leave their bad state (False, True, True).

    Becoming Degraded or stalled, losing Ready or the verified path, is a Warning; everything else is Normal.
    """
    before = {c.get("type"): c.get("status") for c in previous}
    events = []
    for c in current:
        old = before.get(c["type"])
        bad = BAD.get(c["type"])
        if old == c["status"] or (bad and bad not in (old, c["status"])):
            continue
        degraded = c["type"] == names.DEGRADED and c["status"] == "True"
        lost_ready = c["type"] == names.READY and old == "True"
        stalled = c["reason"] == "ProgressDeadlineExceeded" or c["status"] == bad
        kind = "Warning" if degraded or lost_ready or stalled else "Normal"
        events.append(Event(kind, c["reason"], f"{c['type']}={c['status']}: {c['message']}"))
    return events
