"""Schema of the CRD's role blocks (spec.prefill, spec.decode, spec.router) and of the engine settings."""

from typing import Any

from .schema import free_obj, integer, obj, string
from .spec import DEFAULT_ENGINE

DTYPES = ["float32", "bfloat16", "float16"]


def engine_props(with_defaults: bool) -> dict:
    d: dict[str, Any] = DEFAULT_ENGINE if with_defaults else {}
    return {
        "pageSize": integer(d.get("pageSize"), 1, "Tokens per KV page; prefill and decode must agree."),
        "kvDtype": string(
            "KV cache dtype; prefill and decode must agree.",
            16,
            enum=DTYPES,
            **({"default": d["kvDtype"]} if d else {}),
        ),
        "dtype": string("Model weights dtype.", 16, enum=DTYPES, **({"default": d["dtype"]} if d else {})),
        "chunkSize": integer(d.get("chunkSize"), 1, "Chunked-prefill size in tokens."),
        "maxTotalTokens": integer(d.get("maxTotalTokens"), 1, "KV cache capacity in tokens."),
        "maxRunningRequests": integer(d.get("maxRunningRequests"), 1, "Requests running at once."),
    }


def _placement_props() -> dict:
    quantities = {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True}}
    return {
        "resources": obj(
            {
                "requests": quantities,
                "limits": quantities,
                "gpus": integer(
                    0,
                    0,
                    "GPUs per pod: 0 runs the ranks on the CPU; otherwise tpSize * ppSize, one per rank, "
                    "and the ranks run on CUDA (`--device cuda`).",
                ),
                "rdma": integer(1, 0, "RDMA devices per pod, requested when transfer.protocol is rdma."),
            },
            "Pod resources.",
            default={},
        ),
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": free_obj("A core/v1 Toleration.")},
        "affinity": free_obj("A core/v1 Affinity; without a podAntiAffinity the pods prefer distinct nodes."),
        "topologySpreadConstraints": {
            "type": "array",
            "maxItems": 8,
            "items": {
                **free_obj("A core/v1 TopologySpreadConstraint; labelSelector defaults to the role's pods."),
                "required": ["maxSkew", "topologyKey", "whenUnsatisfiable"],
            },
            "description": "How the role's pods spread; default: across nodes, maxSkew 1, ScheduleAnyway. "
            "An empty list spreads nothing.",
        },
        "env": {"type": "array", "items": {**free_obj("A core/v1 EnvVar."), "required": ["name"]}},
        "args": {"type": "array", "items": {"type": "string"}, "description": "Extra command-line arguments."},
    }


def worker_role_schema(role: str) -> dict:
    return obj(
        {
            "replicas": integer(1, doc=f"Number of {role} pods."),
            "tpSize": integer(1, 1, "Tensor-parallel size: ranks per pipeline stage, one process (and GPU) each."),
            "ppSize": integer(1, 1, "Pipeline-parallel size: stages; tpSize * ppSize ranks fit one node (<= 8)."),
            "epSize": integer(
                1,
                1,
                "Expert-parallel size for MoE models (DeepSeek-V3, Qwen3-MoE): 1, or tpSize (each tensor rank then "
                "holds its share of the routed experts whole and tokens reach them by all-to-all).",
            ),
            "engine": obj(engine_props(False), f"Engine settings for {role} only, over spec.engine.", default={}),
            **_placement_props(),
        },
        f"The {role} role.",
        default={},
    )


def router_schema() -> dict:
    props = _placement_props()
    props["resources"] = {
        **props["resources"],
        "description": "Pod resources, each over a default: requests cpu 250m and memory 256Mi, a memory limit "
        "of 1Gi (or the memory request when set); ephemeral storage for /tmp and logs.",
    }
    return obj(
        {
            "replicas": integer(1, doc="Number of router pods."),
            "policy": string(
                "How the router picks workers.", 32, enum=["round_robin", "least_load"], default="round_robin"
            ),
            **props,
        },
        "The router that receives requests and pairs a prefill with a decode worker.",
        default={},
    )
