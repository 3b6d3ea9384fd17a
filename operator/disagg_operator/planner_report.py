"""`status.planner` and the PlannerRecommendation Event: pure functions of a decision.

The status is written only when what it says changes: estimates are rounded to whole milliseconds, and
`lastDecisionTime` moves only with the rest (a decision that repeats the last one writes nothing), so an idle
model with a planner makes no API writes.
"""

import math
from collections.abc import Mapping
from typing import Any

from . import names
from .planner.decide import Decision
from .planner.inputs import Mode, Replicas
from .status import Event

REASON = "PlannerRecommendation"
TIME_KEY = "lastDecisionTime"


def _ms(value: float | None) -> int | None:
    """Whole milliseconds; None (the field removed) when unknown or when the replicas cannot keep up at all (the
    reason and `unreachable` say so)."""
    return None if value is None or math.isinf(value) or math.isnan(value) else round(value)


def _roles(r: Replicas) -> dict[str, int]:
    return {role: r.of(role) for role in names.WORKER_ROLES}


def planner_content(mode: Mode, decision: Decision, current: Replicas, why: str, advisory: tuple[str, ...]) -> dict:
    """What `status.planner` says, without its time. `why`: where the observations came from or why there are
    none; `advisory`: the roles Apply leaves alone (empty outside Apply)."""
    return {
        "mode": mode.value,
        "desired": _roles(decision.desired),
        "current": _roles(current),
        "reason": f"{why}; {decision.reason}" if why else decision.reason,
        "estimatedTtftMs": _ms(decision.estimated_ttft_ms),
        "estimatedItlMs": _ms(decision.estimated_itl_ms),
        "unreachable": list(decision.infeasible),
        "advisoryRoles": list(advisory),
    }


def next_status(previous: Mapping[str, Any] | None, content: Mapping[str, Any], now: str) -> dict | None:
    """The `status.planner` to write, or None when `previous` already says `content` (its time aside)."""
    old = {k: v for k, v in (previous or {}).items() if k != TIME_KEY and v is not None}
    new = {k: v for k, v in content.items() if v is not None}
    if old == new:
        return None
    return {**content, TIME_KEY: now}  # a None removes a field the merge patch finds


def recommendation_event(previous: Mapping[str, Any] | None, content: Mapping[str, Any]) -> Event | None:
    """One Event when the desired replicas change (the first decision counts), none otherwise."""
    before = (previous or {}).get("desired")
    if before == content["desired"]:
        return None
    d = content["desired"]
    was = f" (was prefill {before.get('prefill')}, decode {before.get('decode')})" if before else ""
    message = f"{content['mode']}: prefill {d['prefill']}, decode {d['decode']}{was}: {content['reason']}"
    return Event("Normal", REASON, message[:1000])


def scale_writes(
    writes: Replicas | None, current: Replicas, advisory: tuple[str, ...], ratio_set: bool
) -> dict[str, int]:
    """role -> the replicas Apply writes: the roles the decision changes that no HPA owns; prefill not when it
    follows decode (scaling.prefillPerDecode derives it)."""
    if writes is None:
        return {}
    return {
        role: writes.of(role)
        for role in names.WORKER_ROLES
        if writes.of(role) != current.of(role) and role not in advisory and not (role == names.PREFILL and ratio_set)
    }
