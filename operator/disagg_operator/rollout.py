"""Coordinated prefill/decode rollouts: a pure planner from what the worker StatefulSets and their pods report to
the partitions to apply next, and the Progressing condition and `status.rollout` that describe it.

Each worker StatefulSet rolls with `updateStrategy.rollingUpdate.partition`: pods with an ordinal at or above the
partition run the latest template. When a change alters both roles' templates (image, engine settings, labels ...)
the planner releases one pod at a time: the `order` role first whenever that keeps the released fractions
(released / replicas) of the two roles within `maxSkew`, the other role otherwise, and only once every pod released
so far runs the new template and has been Ready for `minReadySeconds`. `maxSkew` is at least one pod's worth of the
smaller role; with that bound stepping the lagging role always fits, so a rollout never deadlocks (one replica per
role included). A change to one role only rolls that role straight away (partition 0), as a plain StatefulSet
would. Pods carry a pairing revision (builders.pairing_revision) and the router pairs only equal revisions, so no
request crosses from an old prefill to a new decode whose KV layout may differ.

A rollout that makes no progress (no pod released or becoming available) for `progressDeadlineSeconds` is reported
as Progressing=False/ProgressDeadlineExceeded; the planner simply keeps waiting for the released pods, it never
releases more while they are not available.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from . import names
from .observe import PodInfo, RoleObservation, parse_time
from .spec import ModelSpec


@dataclass(frozen=True)
class RoleRollout:
    """Where one worker role stands: `released` pods may run the new template, `available` of them do and have
    been Ready for minReadySeconds; `waiting` names the released pods that are not there yet."""

    role: str
    replicas: int
    released: int
    available: int
    updating: bool  # its pods are moving to a new template (what status shows)
    settled: bool = True  # its controller has seen the latest spec, so its revisions can be trusted
    waiting: tuple[str, ...] = ()

    @property
    def rolling(self) -> bool:
        """Updating, or possibly so: a controller that has not seen the latest spec may be about to start."""
        return self.updating or not self.settled

    @property
    def fraction(self) -> float:
        return self.released / self.replicas if self.replicas else 1.0

    @property
    def step_done(self) -> bool:
        return self.settled and self.available >= self.released


@dataclass(frozen=True)
class RolloutPlan:
    roles: Mapping[str, RoleRollout]
    partitions: Mapping[str, int]
    coordinated: bool
    max_skew: float

    @property
    def active(self) -> bool:
        return any(r.updating for r in self.roles.values())

    @property
    def step(self) -> int:
        return sum(r.released for r in self.roles.values())

    @property
    def steps(self) -> int:
        return sum(r.replicas for r in self.roles.values())


def max_skew(spec: ModelSpec) -> float:
    """The largest allowed difference of released fractions: the user's maxSkew, but at least one pod's worth of
    the role with fewer replicas (a smaller bound could not be kept while moving one pod at a time)."""
    sizes = [spec.replicas(r) for r in names.WORKER_ROLES if spec.replicas(r) > 0]
    floor = max((1 / n for n in sizes), default=1.0)
    asked = (spec.rollout.max_skew_percent or 0) / 100
    return max(floor, asked)


def role_rollout(
    spec: ModelSpec, role: str, obs: RoleObservation | None, pods: Iterable[PodInfo], desired_hash: str, now: float
) -> RoleRollout:
    n = spec.replicas(role)
    if obs is None or n == 0:  # nothing exists to roll yet, or nothing to roll
        return RoleRollout(role, n, n, n, updating=False)
    if obs.template_hash != desired_hash:  # a new template: every pod is old again
        return RoleRollout(role, n, 0, 0, updating=True)
    released = min(n, max(0, n - obs.partition))
    sts = workload_name(spec, role)
    expected = [f"{sts}-{i}" for i in range(n - released, n)]
    new = {p.name: p for p in pods if p.role == role and obs.update_revision and p.revision == obs.update_revision}
    ok = [name for name in expected if name in new and new[name].available(now, spec.rollout.min_ready_s)]
    if spec.worker(role).nodes > 1:  # groups: a leader (`<lws>-<i>`) still on another template, as its pods say
        leaders = {f"{sts}-{i}" for i in range(n)}
        moving = any(p.name in leaders and p.revision != obs.update_revision and not p.terminating for p in pods)
    else:
        moving = obs.current_revision != obs.update_revision
    return RoleRollout(
        role,
        n,
        released,
        len(ok),
        updating=released < n or moving,
        settled=obs.current,
        waiting=tuple(name for name in expected if name not in ok),
    )


def with_leader_counts(
    spec: ModelSpec, observed: Mapping[str, RoleObservation | None], pods: Iterable[PodInfo]
) -> dict[str, RoleObservation | None]:
    """The roles' observations, a role of groups counting as updated only the groups whose leader carries the
    template the operator applied: LWS reports no observed generation, so its `updatedReplicas` still counts the
    old groups until its controller has seen a new template (and the role would look settled meanwhile)."""
    out = dict(observed)
    pods = list(pods)
    for role, obs in observed.items():
        if obs is None or role == names.ROUTER or spec.worker(role).nodes <= 1:
            continue
        if not any(p.role == role for p in pods):  # none observed (or none passed): LWS's count stands
            continue
        leaders = {f"{workload_name(spec, role)}-{i}" for i in range(obs.replicas)}
        on_template = sum(p.name in leaders and p.revision == obs.template_hash and not p.terminating for p in pods)
        out[role] = replace(obs, updated=min(obs.updated, on_template))
    return out


def workload_name(spec: ModelSpec, role: str) -> str:
    """The StatefulSet or LeaderWorkerSet whose pods (group leaders) are named `<it>-<ordinal>`."""
    return names.group_set_name(spec.name, role) if spec.worker(role).nodes > 1 else names.child_name(spec.name, role)


def _next_role(roles: Mapping[str, RoleRollout], order: tuple[str, str], skew: float) -> str | None:
    for role in order:
        r = roles[role]
        other = roles[order[1] if role == order[0] else order[0]]
        if r.released < r.replicas and abs((r.released + 1) / r.replicas - other.fraction) <= skew + 1e-9:
            return role
    return None


def plan_rollout(
    spec: ModelSpec,
    observed: Mapping[str, RoleObservation | None],
    pods: Iterable[PodInfo],
    desired_hashes: Mapping[str, str],
    now: float,
) -> RolloutPlan:
    """The partitions to apply now. Idempotent: planning again from the same observation gives the same answer."""
    pods = list(pods)
    roles = {
        r: role_rollout(spec, r, observed.get(r), pods, desired_hashes.get(r, ""), now) for r in names.WORKER_ROLES
    }
    skew = max_skew(spec)
    if sum(r.rolling for r in roles.values()) < 2:  # one role (or none) changes: it rolls on its own
        return RolloutPlan(roles, {r: 0 for r in roles}, coordinated=False, max_skew=skew)
    if all(r.step_done for r in roles.values()):
        role = _next_role(roles, spec.rollout.order, skew)
        if role is not None:
            r = roles[role]
            sts = workload_name(spec, role)
            roles[role] = replace(
                r, released=r.released + 1, waiting=(f"{sts}-{r.replicas - r.released - 1}", *r.waiting)
            )
    partitions = {name: r.replicas - r.released for name, r in roles.items()}
    return RolloutPlan(roles, partitions, coordinated=True, max_skew=skew)


def rollout_status(plan: RolloutPlan, revision: str, previous: Mapping[str, Any] | None, now: str) -> dict | None:
    """`status.rollout` while a rollout runs (None clears it): the progress per role and when it last moved."""
    if not plan.active:
        return None
    progress = {r: {"released": x.released, "updatedReady": x.available} for r, x in plan.roles.items()}
    prev = previous or {}
    moved = prev.get("revision") != revision or any(prev.get(r) != progress[r] for r in progress)
    return {
        "revision": revision,
        "step": plan.step,
        "steps": plan.steps,
        **progress,
        "lastProgressTime": now if moved or not prev.get("lastProgressTime") else prev["lastProgressTime"],
    }


def _progress_text(spec: ModelSpec, plan: RolloutPlan) -> str:
    counts = ", ".join(f"{r} {x.available}/{x.replicas}" for r, x in plan.roles.items() if x.updating)
    if not plan.coordinated:
        return f"updating {counts} pods on the new template"
    first = spec.rollout.order[0]
    return (
        f"step {plan.step} of {plan.steps}, {first} first, maxSkew {round(plan.max_skew * 100)}%: "
        f"{counts} pods updated and available"
    )


def progressing_condition(
    spec: ModelSpec, plan: RolloutPlan, status: Mapping[str, Any] | None, now: str
) -> tuple[bool, str, str] | None:
    """(status, reason, message) of Progressing during a rollout; None when no rollout runs."""
    if not plan.active or status is None:
        return None
    waiting = [w for r in plan.roles.values() for w in r.waiting]
    pending = f"; waiting for {', '.join(waiting[:6])}" if waiting else ""
    last, current = parse_time(status.get("lastProgressTime")), parse_time(now)
    deadline = spec.rollout.progress_deadline_s
    if last is not None and current is not None and current - last > deadline:
        return (
            False,
            "ProgressDeadlineExceeded",
            f"no progress for over {deadline} s (spec.rollout.progressDeadlineSeconds): "
            f"{', '.join(waiting[:6]) or 'pods'} not available on the new template; {_progress_text(spec, plan)}",
        )
    return True, "RollingOut", _progress_text(spec, plan) + pending
