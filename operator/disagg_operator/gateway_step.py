"""Applying the gateway's children (`spec.gateway`; builders/gateway.py) on their own, after the model's others.

What fails here (a cluster without the InferencePool or HTTPRoute CRD, a write the operator's RBAC refuses) is the
gateway's alone: it is recorded for the status (Degraded, naming what is missing), told once in a Warning Event,
and retried by the CR's handler, while the workers and the router are applied and reported as ever.
"""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import builders
from .apply import Kube
from .apply_errors import ReconcileError
from .config import OperatorConfig
from .model_state import ModelState
from .prune import prune
from .spec import ModelSpec
from .status import GATEWAY_UNAVAILABLE, Event


def reconcile_gateway(
    apply: Callable[[Iterable[Mapping[str, Any]]], None],
    kube: Kube,
    cfg: OperatorConfig,
    cr: Mapping[str, Any],
    spec: ModelSpec,
    m: ModelState,
    post_event: Callable[[Mapping[str, Any], Event], None],
) -> None:
    """Apply what `spec.gateway` asks for and delete what it no longer does; `m.gateway_errors` says how it went.
    Without the block this is the prune alone: one read per name per operator start (prune.py), none after, and a
    cluster without the CRDs answers those reads with 404, which is "absent", not a failure."""
    try:
        apply(builders.build_gateway_children(spec, cfg))
        prune(kube, spec, builders.retired_gateway(spec), m.pruned, m.owned)
        errors = []
    except ReconcileError as e:
        errors = [str(e)]
    if errors and errors != m.gateway_errors:
        post_event(cr, Event("Warning", GATEWAY_UNAVAILABLE, errors[0]))
    m.gateway_errors = errors
