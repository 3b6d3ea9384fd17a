"""The model served through a Gateway API gateway (`spec.gateway`; docs/gateway.md): the InferencePool of the pods
that take the gateway's requests, its endpoint picker (epp.py), the NetworkPolicies that let the gateway in, and,
with `spec.gateway.httpRoute`, the HTTPRoute from the named Gateways to the pool.

The pool is the decode pods: in P/D they are what a Gateway API Inference Extension gateway sends a request to (a
decode pod performs the hand-off to the prefill the request names; docs/routing.md). The picker names that prefill
(`--prefill-dns`), the decode pods admit exactly the model's prefills (`--prefill-allow`, builders/workers.py), and
a NetworkPolicy lets the decode pods and the picker reach the prefills' serving port. Applied after every other
child, and on their own (reconcile.py): a cluster without the InferencePool or HTTPRoute CRD leaves the model
serving through its router, Degraded naming the CRD.
"""

from typing import Any

from .. import names
from ..config import OperatorConfig
from ..gateway_spec import GatewaySpec
from ..spec import ModelSpec
from .common import front_end_labels, metadata, selector_labels
from .epp import (
    GRPC_PORT,
    HEALTH_PORT,
    METRICS_PORT,
    build_epp_deployment,
    build_epp_service,
    build_epp_service_account,
)
from .policy import build_pdb

POOL_ROLE = names.DECODE


def pool_name(spec: ModelSpec) -> str:
    """The InferencePool (and the HTTPRoute) carry the model's own name: it is what a user's HTTPRoute names."""
    return spec.name


def build_inference_pool(spec: ModelSpec, gateway: GatewaySpec) -> dict[str, Any]:
    return {
        "apiVersion": names.POOL_API_VERSION,
        "kind": names.POOL_KIND,
        "metadata": metadata(spec, pool_name(spec), "gateway"),
        "spec": {
            "selector": {"matchLabels": front_end_labels(spec, POOL_ROLE)},
            "targetPorts": [{"number": names.HTTP_PORT}],
            "endpointPickerRef": {
                "name": names.epp_name(spec.name),
                "port": {"number": GRPC_PORT},
                "failureMode": gateway.failure_mode,
            },
        },
    }


def build_http_route(spec: ModelSpec, gateway: GatewaySpec) -> dict[str, Any] | None:
    """Every request the named Gateways take (for the route's hostnames, if any) to the pool; None without
    `spec.gateway.httpRoute`."""
    route = gateway.route
    if route is None:
        return None
    body: dict[str, Any] = {"parentRefs": [p.manifest() for p in route.parent_refs]}
    if route.hostnames:
        body["hostnames"] = list(route.hostnames)
    body["rules"] = [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
            "backendRefs": [{"group": names.INFERENCE_GROUP, "kind": names.POOL_KIND, "name": pool_name(spec)}],
        }
    ]
    return {
        "apiVersion": names.ROUTE_API_VERSION,
        "kind": names.ROUTE_KIND,
        "metadata": metadata(spec, pool_name(spec), "gateway"),
        "spec": body,
    }


def gateway_peers(spec: ModelSpec, gateway: GatewaySpec) -> list[dict[str, Any]]:
    """Who the gateway is, as NetworkPolicy peers: `allowFrom` when set; else the pods Istio and kgateway deploy for
    the route's Gateways (labelled with the Gateway's name, in its namespace); else any pod of any namespace."""
    if gateway.allow_from is not None:
        return [dict(p) for p in gateway.allow_from]
    refs = gateway.route.parent_refs if gateway.route else ()
    if not refs:
        return [{"namespaceSelector": {}}]
    return [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ref.namespace or spec.namespace}},
            "podSelector": {"matchLabels": {names.GATEWAY_NAME_LABEL: ref.name}},
        }
        for ref in refs
    ]


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def build_epp_network_policy(spec: ModelSpec, gateway: GatewaySpec) -> dict[str, Any]:
    """The picker's pods: ext_proc from the gateway only; gRPC health and the metrics from anyone (probes,
    Prometheus; neither says more than the metrics do)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(spec, names.epp_name(spec.name), names.EPP, names.EPP),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec, names.EPP)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [_tcp(GRPC_PORT)], "from": gateway_peers(spec, gateway)},
                {"ports": [_tcp(HEALTH_PORT), _tcp(METRICS_PORT)]},
            ],
        },
    }


def build_pool_network_policy(spec: ModelSpec, gateway: GatewaySpec) -> dict[str, Any]:
    """The pool's pods, beside their own role's policy (policies add up): the serving port from the gateway, which
    sends them the requests, and from the picker, which reads their /health and KV events."""
    picker = {"podSelector": {"matchLabels": selector_labels(spec, names.EPP)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(spec, names.gateway_policy_name(spec.name), "gateway", POOL_ROLE),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec, POOL_ROLE)},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [_tcp(names.HTTP_PORT)], "from": [*gateway_peers(spec, gateway), picker]}],
        },
    }


def build_handoff_network_policy(spec: ModelSpec) -> dict[str, Any]:
    """The prefill pods, beside their own role's policy: the serving port from the decode pods, which hand a gateway's
    request to the prefill it names (its prompt, with the model's worker token), and from the picker, which reads
    the prefills' /health and KV events to pick one."""
    peers = [{"podSelector": {"matchLabels": selector_labels(spec, role)}} for role in (POOL_ROLE, names.EPP)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(spec, names.handoff_policy_name(spec.name), "gateway", names.PREFILL),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec, names.PREFILL)},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [_tcp(names.HTTP_PORT)], "from": peers}],
        },
    }


def build_gateway_children(spec: ModelSpec, cfg: OperatorConfig) -> list[dict[str, Any]]:
    """The gateway's objects in the order they are applied: the picker's identity, Service, pods and their
    disruption budget, the NetworkPolicies, then the pool and the route (whose CRDs a cluster may lack). None
    without `spec.gateway`."""
    gateway = spec.gateway
    if gateway is None:
        return []
    route = build_http_route(spec, gateway)
    return [
        build_epp_service_account(spec),
        build_epp_service(spec),
        build_epp_deployment(spec, gateway, cfg),
        build_pdb(spec, names.EPP),  # a node drain takes one picker pod at a time: the pool keeps its picker
        build_epp_network_policy(spec, gateway),
        build_pool_network_policy(spec, gateway),
        build_handoff_network_policy(spec),
        build_inference_pool(spec, gateway),
        *([route] if route is not None else []),
    ]


GATEWAY_KINDS = (
    ("v1", "ServiceAccount"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


def retired_gateway(spec: ModelSpec) -> list[dict[str, Any]]:
    """The gateway's objects the spec no longer asks for (all of them without `spec.gateway`, the HTTPRoute
    without `httpRoute`): each deleted if this model made it."""
    gateway = spec.gateway

    def ref(api_version: str, kind: str, name: str) -> dict[str, Any]:
        return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": spec.namespace}}

    route = ref(names.ROUTE_API_VERSION, names.ROUTE_KIND, pool_name(spec))
    if gateway is not None:
        return [route] if gateway.route is None else []
    epp = names.epp_name(spec.name)
    return [
        route,
        ref(names.POOL_API_VERSION, names.POOL_KIND, pool_name(spec)),
        *(ref(v, k, epp) for v, k in GATEWAY_KINDS),
        ref("networking.k8s.io/v1", "NetworkPolicy", names.gateway_policy_name(spec.name)),
        ref("networking.k8s.io/v1", "NetworkPolicy", names.handoff_policy_name(spec.name)),
    ]
