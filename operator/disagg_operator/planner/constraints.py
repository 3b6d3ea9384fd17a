"""What bounds a recommendation, applied in this order: the scale-down stabilisation window, the step limit, the
floors and maxima, the rollout hold, the GPU budget.

- Stabilisation, as Kubernetes' HPA does it: a scale-down goes only to the highest recommendation of the last
  window (never above the current count), so a dip in load does not take replicas a returning peak needs and pay
  a cold start; scale-up is immediate, since a missed SLO costs more than an idle replica.
- The step limit bounds one decision's change per role: a wrong model cannot swing a role from 1 to 50.
- Floors and maxima are the user's.
- During a rollout nothing shrinks: removing a replica then could take a pod the rollout is about to release or
  the only verified pair of the new revision. Growth is allowed: added ordinals start on the new template, so only
  the new revision grows. The hold wins over a maximum or budget lowered meanwhile; they take effect when the
  rollout ends.
- The budget caps both roles' GPUs together. Decode is served first: without decode slots no request produces a
  token, while a short prefill only raises TTFT; prefill gets what is left, never below its floor.
"""

from collections.abc import Callable
from dataclasses import dataclass

from .. import names
from ..spec import prefill_for_decode
from .inputs import PlannerSpec, Replicas


@dataclass(frozen=True)
class Recommendation:
    at_s: float
    replicas: Replicas


def roles(spec: PlannerSpec) -> tuple[str, ...]:
    """The roles the planner sizes: with prefillPerDecode only decode (prefill follows it)."""
    return (names.DECODE,) if spec.prefill_per_decode is not None else names.WORKER_ROLES


def follow(spec: PlannerSpec, r: Replicas) -> Replicas:
    """`r` with prefill derived from decode where the spec keeps a ratio."""
    ratio = spec.prefill_per_decode
    return r if ratio is None else Replicas(prefill_for_decode(r.decode, ratio), r.decode)


def _per_role(spec: PlannerSpec, r: Replicas, f: Callable[[str, int], int]) -> Replicas:
    for role in roles(spec):
        r = r.with_role(role, f(role, r.of(role)))
    return follow(spec, r)


def stabilise(
    spec: PlannerSpec, rec: Replicas, current: Replicas, history: tuple[Recommendation, ...], now_s: float
) -> tuple[Replicas, tuple[Recommendation, ...]]:
    """The stabilised replicas and the window's recommendations (this one included) to pass to the next call."""
    window = tuple(h for h in history if now_s - h.at_s < spec.scale_down_stabilization_s)
    window += (Recommendation(now_s, rec),)

    def hold(role: str, n: int) -> int:
        if n >= current.of(role):
            return n
        return min(current.of(role), max(h.replicas.of(role) for h in window))

    return _per_role(spec, rec, hold), window


def step_limit(spec: PlannerSpec, rec: Replicas, current: Replicas) -> Replicas:
    def limit(role: str, n: int) -> int:
        c = current.of(role)
        return max(c - spec.max_step, min(c + spec.max_step, n))

    return _per_role(spec, rec, limit)


def clamp(spec: PlannerSpec, rec: Replicas) -> Replicas:
    return _per_role(spec, rec, lambda role, n: max(spec.limits(role).min, min(spec.limits(role).max, n)))


def floors(spec: PlannerSpec, current: Replicas, rolling: bool) -> Replicas:
    """The least each role may have: its minimum, and during a rollout what it has now."""
    return Replicas(
        max(spec.prefill.min, current.prefill if rolling else 0), max(spec.decode.min, current.decode if rolling else 0)
    )


def hold_rollout(spec: PlannerSpec, rec: Replicas, current: Replicas, rolling: bool) -> Replicas:
    return _per_role(spec, rec, lambda role, n: max(n, current.of(role))) if rolling else rec


def fit_budget(spec: PlannerSpec, rec: Replicas, least: Replicas) -> Replicas:
    budget = spec.gpu_budget
    if budget is None or rec.gpus(spec) <= budget:
        return rec
    if spec.prefill_per_decode is not None:
        d = rec.decode
        while d > least.decode and follow(spec, Replicas(0, d)).gpus(spec) > budget:
            d -= 1
        return follow(spec, Replicas(0, d))
    gp, gd = spec.prefill.gpus, spec.decode.gpus
    decode = rec.decode
    if gd > 0:
        decode = min(decode, max(least.decode, (budget - least.prefill * gp) // gd))
    prefill = rec.prefill
    if gp > 0:
        prefill = min(prefill, max(least.prefill, (budget - decode * gd) // gp))
    return Replicas(prefill, decode)
