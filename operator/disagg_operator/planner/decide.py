"""The decision: observations, capacity model, spec, current replicas and rollout state -> desired replicas.

Slow loop (sizing.py) -> fast correction (correction.py) -> the relation between the roles -> the bounds
(constraints.py). Pure: the caller passes the clock and the window of past recommendations in and keeps the ones
returned, so a replay on a virtual clock sees exactly what the operator would.

Modes: Off decides nothing (the current replicas, no history kept); Advisory and Apply decide alike, and only
Apply asks for writes. Missing observations (a router down, no scrape) or no capacity model yet (no profile, no
step records) freeze the planner at the current replicas and say why: guessing would scale on nothing.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from .. import names
from . import capacity as C
from . import constraints as K
from .correction import correct
from .inputs import Mode, Observations, PlannerSpec, Replicas
from .sizing import Need, decode_context, size_decode, size_prefill


@dataclass(frozen=True)
class Decision:
    desired: Replicas
    reason: str
    history: tuple[K.Recommendation, ...] = ()
    writes: Replicas | None = None  # what Apply writes; None: nothing to write (Off, Advisory, no change)
    estimated_ttft_ms: float | None = None  # at `desired`; inf: it cannot keep up
    estimated_itl_ms: float | None = None
    infeasible: tuple[str, ...] = ()  # the roles whose target no replica count meets


def _hold(current: Replicas, why: str, history: tuple[K.Recommendation, ...] = ()) -> Decision:
    return Decision(current, why, history)


def _needs(obs: Observations, model: C.CapacityModel, spec: PlannerSpec, current: Replicas) -> tuple[Need, Need]:
    pct = f"p{spec.slo.percentile:g}"
    prefill = correct(size_prefill(obs, model, spec.slo), current.prefill, obs.ttft_ms, spec.slo.ttft_ms, f"TTFT {pct}")
    decode = correct(size_decode(obs, model, spec.slo), current.decode, obs.itl_ms, spec.slo.itl_ms, f"ITL {pct}")
    return prefill, decode


def _relate(spec: PlannerSpec, prefill: Need, decode: Need) -> Replicas:
    """With a ratio, decode is sized so that the prefill it implies meets prefill's need too."""
    ratio = spec.prefill_per_decode
    if ratio is None:
        return Replicas(prefill.replicas, decode.replicas)
    return K.follow(spec, Replicas(0, max(decode.replicas, math.ceil(prefill.replicas / ratio - 1e-9))))


def _bound(
    spec: PlannerSpec,
    rec: Replicas,
    current: Replicas,
    rolling: bool,
    history: tuple[K.Recommendation, ...],
    now_s: float,
) -> tuple[Replicas, tuple[K.Recommendation, ...], list[str]]:
    """The recommendation through each bound in turn, with a note for each that changed it."""
    stabilised, window = K.stabilise(spec, rec, current, history, now_s)
    bounds: list[tuple[str, Callable[[Replicas], Replicas]]] = [
        ("step limit", lambda r: K.step_limit(spec, r, current)),
        ("floors and maxima", lambda r: K.clamp(spec, r)),
        ("rollout in progress: nothing shrinks", lambda r: K.hold_rollout(spec, r, current, rolling)),
        ("GPU budget, decode first", lambda r: K.fit_budget(spec, r, K.floors(spec, current, rolling))),
    ]
    notes = [f"held by the scale-down stabilisation window: {stabilised}"] if stabilised != rec else []
    before = stabilised
    for why, bound in bounds:
        after = bound(before)
        if after != before:
            notes.append(f"{why}: {after}")
        before = after
    return before, window, notes


def plan(
    obs: Observations | None,
    model: C.CapacityModel | None,
    spec: PlannerSpec,
    current: Replicas,
    rolling: bool = False,
    history: tuple[K.Recommendation, ...] = (),
    now_s: float = 0.0,
) -> Decision:
    if spec.mode is Mode.OFF:
        return _hold(current, "planner off")
    if obs is None:
        return _hold(current, "observations missing: holding the current replicas", history)
    if model is None:
        return _hold(current, "no capacity model yet (no profile, no step records): holding", history)
    prefill, decode = _needs(obs, model, spec, current)
    rec = _relate(spec, prefill, decode)
    desired, window, notes = _bound(spec, rec, current, rolling, history, now_s)
    reason = "; ".join([prefill.reason, decode.reason, f"recommended {rec}", *notes])
    change = spec.mode is Mode.APPLY and desired != current
    return Decision(
        desired,
        reason,
        window,
        desired if change else None,
        C.estimated_ttft_ms(
            model, obs.arrival_rate * obs.uncached_prompt_tokens, obs.uncached_prompt_tokens, desired.prefill
        ),
        C.estimated_itl_ms(model, obs.arrival_rate * obs.output_tokens, decode_context(obs), desired.decode),
        tuple(r for r, n in ((names.PREFILL, prefill), (names.DECODE, decode)) if not n.feasible),
    )
