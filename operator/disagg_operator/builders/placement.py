"""Where a role's pods land: the user's node selector, tolerations and affinity, plus spreading across nodes.

Replicas of a role are spread over nodes so that one node's loss does not take a whole role (for the router:
the whole API) down. Every spread is soft, by default: a preferred podAntiAffinity and a `ScheduleAnyway`
topology spread on the node name, so a GPU is never left idle because a hard rule found no other node. The CR
replaces the default spread with its own `topologySpreadConstraints` (an empty list: none), and a
podAntiAffinity of its own replaces the default one.
"""

from typing import Any

from ..spec import ModelSpec, Placement
from .common import selector_labels

HOSTNAME = "kubernetes.io/hostname"


def default_spread(spec: ModelSpec, role: str) -> list[dict[str, Any]]:
    return [
        {
            "maxSkew": 1,
            "topologyKey": HOSTNAME,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(spec, role)},
        }
    ]


def spread(spec: ModelSpec, role: str, placement: Placement) -> list[dict[str, Any]]:
    """The CR's constraints (a missing labelSelector selects the role's pods), or the default."""
    if placement.spread is None:
        return default_spread(spec, role)
    selector = {"matchLabels": selector_labels(spec, role)}
    return [{"labelSelector": selector, **c} for c in placement.spread]


def affinity(spec: ModelSpec, role: str, placement: Placement) -> dict[str, Any]:
    """The CR's affinity, with a preferred podAntiAffinity on the node name unless it has one of its own."""
    out = dict(placement.affinity)
    if "podAntiAffinity" not in out:
        term = {"labelSelector": {"matchLabels": selector_labels(spec, role)}, "topologyKey": HOSTNAME}
        out["podAntiAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
        }
    return out


def scheduling(spec: ModelSpec, role: str, placement: Placement) -> dict[str, Any]:
    """The pod-spec fields that place a role's pods."""
    out: dict[str, Any] = {"affinity": affinity(spec, role, placement)}
    constraints = spread(spec, role, placement)
    if constraints:
        out["topologySpreadConstraints"] = constraints
    if placement.node_selector:
        out["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        out["tolerations"] = [dict(t) for t in placement.tolerations]
    return out
