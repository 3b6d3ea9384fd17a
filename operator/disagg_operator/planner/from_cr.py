"""A DisaggregatedModel's `spec` -> the planner's PlannerSpec (None: no planner block, or mode Off).

The defaults are the schema's (crd_planner.py), so a CR read before the API server defaulted it (a test, a dry
run) means the same; a role's GPUs per replica are its `resources.gpus`.
"""

from collections.abc import Mapping
from typing import Any

from .. import crd_planner as D
from .. import names
from .capacity import CapacityModel, StepModel
from .inputs import Mode, PlannerSpec, RoleLimits, Slo


def _limits(planner: Mapping[str, Any], spec: Mapping[str, Any], role: str) -> RoleLimits:
    bounds = planner.get(role) or {}
    gpus = int(((spec.get(role) or {}).get("resources") or {}).get("gpus", 0))
    return RoleLimits(
        int(bounds.get("minReplicas", D.DEFAULT_MIN_REPLICAS)),
        int(bounds.get("maxReplicas", D.DEFAULT_MAX_REPLICAS)),
        gpus,
    )


def planner_spec(spec: Mapping[str, Any]) -> PlannerSpec | None:
    scaling = spec.get("scaling") or {}
    planner, slo = scaling.get("planner"), scaling.get("slo")
    if planner is None or slo is None:
        return None
    mode = Mode(planner.get("mode", "Advisory"))
    if mode is Mode.OFF:
        return None
    ratio = scaling.get("prefillPerDecode")
    keep_ratio = planner.get("relation", "Independent") == "PrefillPerDecode"
    budget = planner.get("gpuBudget")
    return PlannerSpec(
        slo=Slo(float(slo["ttftMs"]), float(slo["itlMs"]), float(slo.get("percentile", D.DEFAULT_PERCENTILE))),
        mode=mode,
        prefill=_limits(planner, spec, names.PREFILL),
        decode=_limits(planner, spec, names.DECODE),
        gpu_budget=int(budget) if budget is not None else None,
        prefill_per_decode=float(ratio) if keep_ratio and ratio is not None else None,
        max_step=int(planner.get("maxStepReplicas", D.DEFAULT_MAX_STEP)),
        scale_down_stabilization_s=float(planner.get("scaleDownStabilizationSeconds", D.DEFAULT_STABILIZATION_S)),
    )


def capacity_model(spec: Mapping[str, Any]) -> CapacityModel | None:
    """`spec.scaling.planner.profile` as the planner's capacity model; None without one (the workers record no
    steps yet, so there is nothing to fit: the planner holds and says so)."""
    profile = ((spec.get("scaling") or {}).get("planner") or {}).get("profile")
    if not profile:
        return None
    defaults = CapacityModel(StepModel(0.0), StepModel(0.0))
    return CapacityModel(
        StepModel(float(profile["prefillBaseMs"]), per_prefill_token_ms=float(profile["prefillMsPerToken"])),
        StepModel(float(profile["decodeBaseMs"]), per_kv_token_ms=float(profile["decodeMsPerKvToken"])),
        int(profile.get("maxPrefillTokens", defaults.max_prefill_tokens)),
        int(profile.get("decodeKvTokens", defaults.decode_kv_tokens)),
    )


def decision_interval_s(spec: Mapping[str, Any]) -> float:
    """Seconds between two decisions: the fast loop's interval (the core sizes and corrects in one decision)."""
    planner = (spec.get("scaling") or {}).get("planner") or {}
    return float(planner.get("correctionIntervalSeconds", D.DEFAULT_CORRECTION_INTERVAL_S))
