"""The `spec.gateway` schema of the DisaggregatedModel CRD: the model served through a Gateway API gateway (the
InferencePool, its endpoint picker, and an optional HTTPRoute; builders/gateway.py)."""

from disagg_api import router_settings as R

from .crd_roles import placement_props
from .gateway_spec import DEFAULT_EPP_POLICY, FAIL_MODES
from .schema import free_obj, integer, obj, string

# (where, rule, message) checked by the API server, as crd.RULES.
GATEWAY_RULES = [
    (
        "spec",
        "!has(self.gateway) || !has(self.gateway.policy) || self.gateway.policy != 'cache_aware' || "
        "!has(self.model.huggingFaceId)",
        "gateway.policy cache_aware reads the model's tokenizer from its files: the model must be on a volume "
        "(model.path) or built in (model.builtin), not downloaded (model.huggingFaceId)",
    ),
]


def _http_route() -> dict:
    parent = obj(
        {
            "name": string("Name of the Gateway."),
            "namespace": string("Its namespace (default: the model's; the Gateway must allow routes from it).", 63),
            "sectionName": string("One listener of the Gateway (default: all that admit the route).", 253),
        },
        "A Gateway the route attaches to.",
        required=["name"],
    )
    return obj(
        {
            "parentRefs": {"type": "array", "minItems": 1, "maxItems": 32, "items": parent},
            "hostnames": {
                "type": "array",
                "maxItems": 16,
                "items": string("A host name the route matches, as the Gateway API's HTTPRoute.spec.hostnames."),
            },
        },
        "An HTTPRoute (gateway.networking.k8s.io/v1, named after the model) sending every path of these Gateways "
        "to the pool; absent: none is made (route to the InferencePool yourself).",
        required=["parentRefs"],
    )


def gateway_schema() -> dict:
    props = placement_props()
    props["resources"] = {
        **props["resources"],
        "description": "The picker's pod resources, each over a default: requests cpu 250m and memory 256Mi, a "
        "memory limit of 1Gi (or the memory request when set); ephemeral storage for /tmp and logs.",
    }
    return obj(
        {
            "enabled": {
                "type": "boolean",
                "default": True,
                "description": "false removes the pool, the picker and the route while keeping these settings.",
            },
            "image": string("Image of the endpoint picker (`disagg epp`); default: the worker image.", 512),
            "replicas": integer(1, 0, "Endpoint picker pods."),
            "failureMode": string(
                "What the gateway does with a request while the picker cannot be reached: FailClose refuses it "
                "(5xx), FailOpen sends it to a pod of the pool without a pick (the InferencePool's "
                "endpointPickerRef.failureMode).",
                16,
                enum=list(FAIL_MODES),
                default="FailClose",
            ),
            "policy": string(
                "How the picker chooses a decode pod (the router's policies: cache_aware by the prompt tokens each "
                "holds, from its KV events, mounting the model for its tokenizer as the router does).",
                32,
                enum=list(R.POLICIES),
                default=DEFAULT_EPP_POLICY,
            ),
            "httpRoute": _http_route(),
            "allowFrom": {
                "type": "array",
                "maxItems": 16,
                "items": free_obj("A networking.k8s.io/v1 NetworkPolicyPeer (podSelector, namespaceSelector)."),
                "description": "The gateway's pods, admitted to the picker's ext_proc port and the pool's serving "
                "port. Default: the pods labelled gateway.networking.k8s.io/gateway-name=<Gateway> in each "
                "httpRoute Gateway's namespace (as Istio and kgateway label them); without httpRoute, any pod.",
            },
            **props,
        },
        "Serve the model through a Gateway API gateway (the Gateway API Inference Extension): the operator makes "
        "an InferencePool (named after the model) of the decode pods, its endpoint picker (`disagg epp`: a "
        "Deployment, Service and ServiceAccount named <model>-epp, granted no API access), NetworkPolicies that "
        "let the gateway in, and optionally an HTTPRoute. Needs the InferencePool CRD "
        "(inference.networking.k8s.io/v1).",
    )
