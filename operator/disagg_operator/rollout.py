"""Coordinated prefill/decode rollouts: a pure planner from what the worker StatefulSets and their pods report to
the replicas and partitions to apply next, and the Progressing condition and `status.rollout` that describe it.

Each worker StatefulSet rolls with `updateStrategy.rollingUpdate.partition`: pods with an ordinal at or above the
partition run the latest template.

Surge (`spec.rollout.maxSurge`, one pod per role by default). A StatefulSet cannot run two templates side by side
except through its partition, so a rollout first grows each role by its surge with the partition held at the old
size: the added ordinals start on the new template beside the old pods, and the router pairs new with new as soon
as they verify (it pairs only pods of one pairing revision). Only once those surge pods are available, and the
routers (as the operator reads their /health) have verified a pair of the new revision without the pod about to
leave, do old pods go, one step at a time as below, each draining what it holds while the new pairs serve; when
every pod runs the new template and a verified pair serves without any surge pod that is leaving, the roles shrink
back and the highest ordinals (new pods) drain and leave. Without router reports (probing off) readiness alone
decides. Surge pods the scheduler finds no node for within `progressDeadlineSeconds` are given up: the model
reports Progressing=False/SurgeUnschedulable and rolls in place, as `maxSurge: 0` does. A model with a role of
groups spanning nodes (LeaderWorkerSets), or a role without replicas, rolls in place: a new pair needs a new pod
of each role.

Steps. When a change alters both roles' templates (image, engine settings, labels ...) the planner releases one
pod at a time: the `order` role first whenever that keeps the released fractions (released / pods) of the two roles
within `maxSkew`, the other role otherwise, and only once every pod released so far runs the new template and has
been Ready for `minReadySeconds`. `maxSkew` is at least one pod's worth of the smaller role; with that bound stepping
the lagging role always fits, so a rollout never deadlocks (one replica per role included). A change to one role
only rolls that role straight away (partition 0, once its surge pods are available), as a plain StatefulSet would.
Pods carry a pairing revision (builders.pairing_revision) and the router pairs only equal revisions, so no request
crosses from an old prefill to a new decode whose KV layout may differ.

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

# The (prefill, decode) pods of the new pairing revision the routers verified; None when they cannot be read.
Verified = frozenset[tuple[str, str]] | None


def serving_without(verified: Verified, leaving: Iterable[str]) -> bool:
    """Whether a verified pair of the new revision serves without the `leaving` pods (unknown counts as yes)."""
    gone = set(leaving)
    return verified is None or any(p not in gone and d not in gone for p, d in verified)


@dataclass(frozen=True)
class RoleRollout:
    """Where one worker role stands: of its `pods` (replicas plus the surge), `released` may run the new template,
    `available` of them do and have been Ready for minReadySeconds; `waiting` names the released pods that are not
    there yet, `unschedulable` the surge pods the scheduler has found no node for since the progress deadline."""

    role: str
    replicas: int
    released: int
    available: int
    updating: bool  # its pods are moving to a new template (what status shows)
    settled: bool = True  # its controller has seen the latest spec, so its revisions can be trusted
    waiting: tuple[str, ...] = ()
    surge: int = 0
    unschedulable: tuple[str, ...] = ()
    shrinkable: bool = False

    @property
    def pods(self) -> int:
        return self.replicas + self.surge

    @property
    def rolling(self) -> bool:
        """Updating, or possibly so: a controller that has not seen the latest spec may be about to start."""
        return self.updating or not self.settled

    @property
    def fraction(self) -> float:
        return self.released / self.pods if self.pods else 1.0

    @property
    def step_done(self) -> bool:
        return self.settled and self.available >= self.released


@dataclass(frozen=True)
class RolloutPlan:
    roles: Mapping[str, RoleRollout]
    partitions: Mapping[str, int]
    coordinated: bool
    max_skew: float
    in_place: tuple[str, ...] = ()  # the surge pods given up (unschedulable): the rollout runs in place

    @property
    def replicas(self) -> dict[str, int]:
        """Each worker set's replicas: its role's, plus the surge while the role rolls."""
        return {name: r.pods for name, r in self.roles.items()}

    @property
    def surges(self) -> dict[str, int]:
        return {name: r.surge for name, r in self.roles.items()}

    @property
    def active(self) -> bool:
        return any(r.updating for r in self.roles.values())

    @property
    def step(self) -> int:
        return sum(r.released for r in self.roles.values())

    @property
    def steps(self) -> int:
        return sum(r.pods for r in self.roles.values())


def max_skew(spec: ModelSpec) -> float:
    """The largest allowed difference of released fractions: the user's maxSkew, but at least one pod's worth of
    the role with fewer replicas (a smaller bound could not be kept while moving one pod at a time)."""
    sizes = [spec.replicas(r) for r in names.WORKER_ROLES if spec.replicas(r) > 0]
    floor = max((1 / n for n in sizes), default=1.0)
    asked = (spec.rollout.max_skew_percent or 0) / 100
    return max(floor, asked)


def surge_of(spec: ModelSpec) -> int:
    """Pods each worker role adds beside its old ones while it rolls. None unless both roles can: a new pair needs
    a new pod of each, and groups spanning nodes (LeaderWorkerSets) and a role without replicas roll in place."""
    if any(spec.replicas(r) == 0 or spec.worker(r).nodes > 1 for r in names.WORKER_ROLES):
        return 0
    return spec.rollout.max_surge


def role_rollout(
    spec: ModelSpec,
    role: str,
    obs: RoleObservation | None,
    pods: Iterable[PodInfo],
    desired_hash: str,
    now: float,
    surge: int = 0,
) -> RoleRollout:
    n = spec.replicas(role)
    if obs is None or n == 0:  # nothing exists to roll yet, or nothing to roll
        return RoleRollout(role, n, n, n, updating=False)
    sts = workload_name(spec, role)
    if obs.template_hash != desired_hash:  # a new template: every pod is old again, the surge pods start new
        surging = tuple(f"{sts}-{i}" for i in range(n, n + surge))
        return RoleRollout(role, n, surge, 0, updating=True, waiting=surging, surge=surge)
    total = n + surge
    released = min(total, max(surge, total - obs.partition))  # the surge ordinals start on the new template
    expected = [f"{sts}-{i}" for i in range(total - released, total)]
    pods = list(pods)
    new = {p.name: p for p in pods if p.role == role and obs.update_revision and p.revision == obs.update_revision}
    ok = [name for name in expected if name in new and new[name].available(now, spec.rollout.min_ready_s)]
    if spec.worker(role).nodes > 1:  # groups: a leader (`<lws>-<i>`) still on another template, as its pods say
        leaders = {f"{sts}-{i}" for i in range(n)}
        moving = any(p.name in leaders and p.revision != obs.update_revision and not p.terminating for p in pods)
    else:
        moving = obs.current_revision != obs.update_revision
    updating = released < total or moving
    if surge and not updating and (obs.desired or 0) <= n:  # the surge pods were never asked for, or are going
        return role_rollout(spec, role, obs, pods, desired_hash, now)
    extra = {f"{sts}-{i}" for i in range(n, total)}
    stuck = [p for p in pods if p.name in extra and p.unschedulable_since is not None]
    deadline = spec.rollout.progress_deadline_s
    return RoleRollout(
        role,
        n,
        released,
        len(ok),
        updating=updating,
        settled=obs.current,
        waiting=tuple(name for name in expected if name not in ok),
        surge=surge,
        # Every stuck surge pod, once one has waited past the deadline: the rollout gives them up together.
        unschedulable=tuple(sorted(p.name for p in stuck))
        if any(now - (p.unschedulable_since or now) > deadline for p in stuck)
        else (),
        # Every pod runs the new template and those that stay are available: the surge pods may go (plan_rollout
        # lets them once a verified pair serves without them).
        shrinkable=bool(surge) and not updating and obs.current and set(ok) >= {f"{sts}-{i}" for i in range(n)},
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
        if obs is None or role not in names.WORKER_ROLES or spec.worker(role).nodes <= 1:
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
        if r.released < r.pods and abs((r.released + 1) / r.pods - other.fraction) <= skew + 1e-9:
            return role
    return None


def plan_rollout(
    spec: ModelSpec,
    observed: Mapping[str, RoleObservation | None],
    pods: Iterable[PodInfo],
    desired_hashes: Mapping[str, str],
    now: float,
    in_place: tuple[str, ...] = (),
    verified: Verified = None,
) -> RolloutPlan:
    """The replicas and partitions to apply now. Idempotent: planning again from the same observation gives the
    same answer. `in_place` names the surge pods already given up for this rollout (then none is started);
    with a surge, no pod leaves before the routers have `verified` a pair of the new revision without it."""
    pods = list(pods)
    surge = 0 if in_place else surge_of(spec)
    roles = {
        r: role_rollout(spec, r, observed.get(r), pods, desired_hashes.get(r, ""), now, surge)
        for r in names.WORKER_ROLES
    }
    unschedulable = tuple(p for r in roles.values() for p in r.unschedulable)
    if unschedulable:  # the surge cannot be placed: roll in place instead
        return plan_rollout(spec, observed, pods, desired_hashes, now, unschedulable)
    shrinking = [r for r in roles.values() if r.shrinkable]
    leaving = [f"{workload_name(spec, r.role)}-{i}" for r in shrinking for i in range(r.replicas, r.pods)]
    if shrinking and serving_without(verified, leaving):  # the surge pods go, together, once a pair serves without
        for r in shrinking:
            roles[r.role] = role_rollout(spec, r.role, observed.get(r.role), pods, desired_hashes[r.role], now)
    skew = max_skew(spec)
    if sum(r.rolling for r in roles.values()) < 2:  # one role (or none) changes: it rolls on its own
        partitions = {name: _alone(spec, r, verified) for name, r in roles.items()}
        return RolloutPlan(roles, partitions, coordinated=False, max_skew=skew, in_place=in_place)
    if all(r.step_done for r in roles.values()):
        role = _next_role(roles, spec.rollout.order, skew)
        if role is not None:
            r = roles[role]
            leaving_one = f"{workload_name(spec, role)}-{r.pods - r.released - 1}"
            if not r.surge or serving_without(verified, [leaving_one]):
                roles[role] = replace(r, released=r.released + 1, waiting=(leaving_one, *r.waiting))
    partitions = {name: r.pods - r.released for name, r in roles.items()}
    return RolloutPlan(roles, partitions, coordinated=True, max_skew=skew, in_place=in_place)


def _alone(spec: ModelSpec, r: RoleRollout, verified: Verified) -> int:
    """The partition of a role that rolls on its own: 0 (its controller replaces the old pods one by one), once
    its surge pods are available and a verified pair serves without its old pods."""
    old = [f"{workload_name(spec, r.role)}-{i}" for i in range(r.replicas)]
    if r.step_done and (not r.surge or r.released >= r.pods or serving_without(verified, old)):
        return 0
    return r.pods - r.released


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
        **({"inPlace": list(plan.in_place)} if plan.in_place else {}),
    }


def given_up(status: Mapping[str, Any] | None, revision: str) -> tuple[str, ...]:
    """The surge pods a rollout to `revision` gave up, as its `status.rollout` records them."""
    status = status or {}
    return tuple(status.get("inPlace") or ()) if status.get("revision") == revision else ()


def _progress_text(spec: ModelSpec, plan: RolloutPlan) -> str:
    counts = ", ".join(f"{r} {x.available}/{x.pods}" for r, x in plan.roles.items() if x.updating)
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
    if plan.in_place and spec.rollout.max_surge:
        return (
            False,
            "SurgeUnschedulable",
            f"no node for {', '.join(plan.in_place[:6])} within {deadline} s (spec.rollout.progressDeadlineSeconds): "
            f"rolling in place instead, old pods leave before new ones start; {_progress_text(spec, plan)}{pending}",
        )
    return True, "RollingOut", _progress_text(spec, plan) + pending
