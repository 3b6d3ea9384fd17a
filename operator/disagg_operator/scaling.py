"""Prefill's RoleScaler and the DisaggregatedModel, kept in step (a pure decision; reconcile.py makes the calls).

The DisaggregatedModel stays the one source of truth the builders read: decode's replicas are its scale
subresource, prefill's are `spec.prefill.replicas`. The RoleScaler `<name>-prefill` is an adapter with its own
scale subresource, so an HPA or `kubectl scale` can drive prefill too:

- someone scaled the RoleScaler (its generation is newer than the one the operator handed on): its replicas are
  written into the DisaggregatedModel;
- otherwise, when the DisaggregatedModel's prefill replicas differ (a user edited them): they are written into the
  RoleScaler, so the two never disagree for long and an HPA reads the true current value;
- with `spec.scaling.prefillPerDecode` prefill follows decode: the RoleScaler only shows the derived value.

The RoleScaler's status (replicas, selector, the generation handed on) is written when it changes, once prefill's
StatefulSet has reached the replicas asked for (a new generation is recorded at once); until the first write,
generation 1, the one it was created with, counts as handed on.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import names
from .builders.common import front_end_labels
from .spec import ModelSpec


@dataclass(frozen=True)
class ScalerObservation:
    replicas: int
    generation: int
    status: Mapping[str, Any]


def observe_scaler(obj: Mapping[str, Any]) -> ScalerObservation:
    return ScalerObservation(
        int((obj.get("spec") or {}).get("replicas", 0)),
        int(obj.get("metadata", {}).get("generation", 0)),
        dict(obj.get("status") or {}),
    )


@dataclass(frozen=True)
class ScalerSync:
    """The writes that bring the pair in step; None where nothing needs writing."""

    model_replicas: int | None = None  # -> DisaggregatedModel spec.prefill.replicas
    scaler_replicas: int | None = None  # -> RoleScaler spec.replicas
    scaler_status: Mapping[str, Any] | None = None


def sync_scaler(spec: ModelSpec, scaler: ScalerObservation, current_replicas: int | None) -> ScalerSync:
    """`current_replicas`: prefill's pods as its StatefulSet reports them (None: not reported yet, the status
    waits)."""
    desired = spec.replicas(names.PREFILL)
    model = scaler_replicas = None
    if spec.prefill_per_decode is not None:
        scaler_replicas = desired if scaler.replicas != desired else None
    elif scaler.generation != scaler.status.get("observedGeneration", 1):  # created (generation 1) in step
        model = scaler.replicas if scaler.replicas != desired else None
    elif scaler.replicas != desired:
        scaler_replicas = desired
    handed_on = model is None and scaler.generation == scaler.status.get("observedGeneration", 1)
    if current_replicas is None or (handed_on and current_replicas != desired):
        return ScalerSync(model, scaler_replicas, None)  # the status waits for the StatefulSet to settle
    status = {
        "replicas": current_replicas,
        "selector": ",".join(f"{k}={v}" for k, v in front_end_labels(spec, names.PREFILL).items()),
        "observedGeneration": scaler.generation,
    }
    changed = any(scaler.status.get(k) != v for k, v in status.items())
    return ScalerSync(model, scaler_replicas, status if changed else None)
