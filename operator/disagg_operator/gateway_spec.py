"""`spec.gateway`: the model served through a Gateway API gateway (the Gateway API Inference Extension), as the
builders need it (builders/gateway.py makes the objects)."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # spec.py imports this module
    from .spec import Placement

FAIL_MODES = ("FailClose", "FailOpen")
DEFAULT_EPP_POLICY = "least_load"


@dataclass(frozen=True)
class ParentRef:
    """A Gateway the HTTPRoute attaches to (a Gateway API ParentReference of kind Gateway)."""

    name: str
    namespace: str | None = None
    section_name: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ParentRef":
        return cls(str(d["name"]), d.get("namespace"), d.get("sectionName"))

    def manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": self.name}
        if self.namespace:
            out["namespace"] = self.namespace
        if self.section_name:
            out["sectionName"] = self.section_name
        return out


@dataclass(frozen=True)
class RouteSpec:
    parent_refs: tuple[ParentRef, ...]
    hostnames: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "RouteSpec | None":
        if not d:
            return None
        return cls(
            tuple(ParentRef.from_dict(p) for p in d.get("parentRefs", ())),
            tuple(str(h) for h in d.get("hostnames", ())),
        )


@dataclass(frozen=True)
class GatewaySpec:
    """The InferencePool, its endpoint picker (`disagg epp`) and, with `route`, the HTTPRoute to the pool.

    `image` None: the model's worker image (it holds `disagg epp`). `allow_from` None: the pods of the route's
    Gateways (their `gateway.networking.k8s.io/gateway-name` label, in the Gateway's namespace), else any pod."""

    placement: "Placement"
    replicas: int = 1
    image: str | None = None
    failure_mode: str = "FailClose"
    policy: str = DEFAULT_EPP_POLICY
    route: RouteSpec | None = None
    allow_from: tuple[Mapping[str, Any], ...] | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, placement: "Placement") -> "GatewaySpec | None":
        """None when the CR has no `spec.gateway` or it is not enabled; `placement`: the picker's pods' (from
        the same block)."""
        if d is None or not d.get("enabled", True):
            return None
        allow = d.get("allowFrom")
        return cls(
            placement,
            int(d.get("replicas", 1)),
            d.get("image"),
            str(d.get("failureMode", "FailClose")),
            str(d.get("policy", DEFAULT_EPP_POLICY)),
            RouteSpec.from_dict(d.get("httpRoute")),
            tuple(allow) if allow is not None else None,
        )

    @property
    def reads_model(self) -> bool:
        """cache_aware tokenises prompts: the picker mounts the model, as the router does."""
        return self.policy == "cache_aware"
