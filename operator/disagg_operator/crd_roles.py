"""Schema of the CRD's role blocks (spec.prefill, spec.decode, spec.router) and of the engine settings."""

from disagg_api.router_settings import POLICIES as ROUTER_POLICIES

from . import names
from .crd_flow import flow_control_schema
from .engine_fields import ENGINE_FIELDS
from .schema import free_obj, integer, obj, string

MAX_NODES_PER_INSTANCE = 8
RANKS = "self.{r}.tpSize * self.{r}.ppSize"
# A role's tensor ranks per attention group (its tpSize without DP attention), in CEL.
ATTN_TP = "(self.{r}.tpSize / self.{r}.dpSize)"


def engine_props(with_defaults: bool) -> dict:
    """The engine block's fields (`engine_fields`); the CRD's defaults only where `with_defaults` (spec.engine)."""
    return {f.name: f.schema(with_defaults) for f in ENGINE_FIELDS}


def placement_props() -> dict:
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
            "ppSize": integer(1, 1, "Pipeline-parallel size: stages; an instance runs tpSize * ppSize ranks."),
            "gpusPerNode": integer(
                8,
                1,
                "Ranks one node runs (its GPUs). An instance of more ranks (tpSize * ppSize, a multiple of this) "
                "spans tpSize * ppSize / gpusPerNode pods, run as a group by a LeaderWorkerSet (LWS must be "
                "installed): pod 0 serves HTTP and bootstrap, the others only their ranks, and a failed pod "
                "restarts the whole group. On the CPU it splits the ranks the same way (one rank per pod with 1).",
                maximum=64,
            ),
            "epSize": integer(
                1,
                1,
                "Expert-parallel size for MoE models (DeepSeek-V3, Qwen3-MoE): 1, or tpSize (each tensor rank then "
                "holds its share of the routed experts whole and tokens reach them by all-to-all).",
            ),
            "enableDpAttention": {
                "type": "boolean",
                "default": False,
                "description": "DP attention (SGLang's --enable-dp-attention): the tensor ranks split into dpSize "
                "attention groups, each with its own requests and KV (an MLA latent cached once per group, not on "
                "every rank); MLP and MoE layers still run over all tpSize ranks.",
            },
            "dpSize": integer(
                1,
                1,
                "Attention groups with enableDpAttention (must divide tpSize). Whole-model data parallelism is "
                "replicas.",
            ),
            "engine": obj(engine_props(False), f"Engine settings for {role} only, over spec.engine.", default={}),
            **(_decode_props() if role == names.DECODE else {}),
            **placement_props(),
        },
        f"The {role} role.",
        default={},
    )


def _decode_props() -> dict:
    return {
        "prefixCache": {
            "type": "boolean",
            "default": False,
            "description": "Keep finished requests' KV on decode (a prefix cache, off by default): a request whose "
            "start a decode pod holds receives only the rest from prefill, and with router.decodeOnlyTokens a "
            "follow-up turn may need no prefill at all. Its pages are published to a cache_aware router.",
        }
    }


def tracing_schema() -> dict:
    ratio = {"type": "number", "minimum": 0, "maximum": 1, "default": 1, "description": "Share of new traces sampled."}
    return obj(
        {
            "otlpEndpoint": string(
                "The OTLP/HTTP collector, as host:port or a URL (/v1/traces appended when it has no path), e.g. "
                "otel-collector.observability:4318.",
                512,
            ),
            "samplingRatio": ratio,
        },
        "OpenTelemetry traces of each request through the router, prefill, the KV transfer and decode, sent by the "
        "router and every worker (--otlp-traces-endpoint). Absent: off.",
        required=["otlpEndpoint"],
    )


def router_schema() -> dict:
    props = placement_props()
    props["resources"] = {
        **props["resources"],
        "description": "Pod resources, each over a default: requests cpu 250m and memory 256Mi, a memory limit "
        "of 1Gi (or the memory request when set); ephemeral storage for /tmp and logs.",
    }
    return obj(
        {
            "replicas": integer(1, doc="Number of router pods."),
            "policy": string(
                "How the router picks workers. cache_aware: each prefill by the prompt tokens it has not cached "
                "(the workers' KV events) plus the prefill tokens the router has running there, each decode by "
                "load; the router reads the model's tokenizer from its files, so the model must be on a volume "
                "the router's pod can mount too (a hostPath present on its node, a PVC that allows a second "
                "read-only mount) or built in.",
                32,
                enum=list(ROUTER_POLICIES),
                default="round_robin",
            ),
            "decodeOnlyTokens": integer(
                0,
                0,
                "Conditional disaggregation (cache_aware only): when the decode pod picked for a request lacks at "
                "most this many of its prompt tokens (its cache from decode.prefixCache, or a short prompt), it "
                "computes them itself and no prefill takes part (no handshake, no KV transfer). 0: off.",
            ),
            "migrationLimit": integer(
                None,
                0,
                "Times a streamed answer whose decode pod fails goes on on another prefill/decode pair from its last "
                "token, the client's stream continuing (the router's --migration-limit; 3 when unset). 0: such a "
                "stream ends with an error event.",
                maximum=100,
            ),
            "flowControl": flow_control_schema(),
            **props,
        },
        "The router that receives requests and pairs a prefill with a decode worker.",
        default={},
    )


# CEL over spec: each worker role's ranks (GPUs, experts, attention groups, one node).
RANK_RULES: list[tuple[str, str, str]] = (
    [
        (
            "spec",
            f"self.{r}.resources.gpus == 0 || self.{r}.resources.gpus == ({RANKS.format(r=r)} <= "
            f"self.{r}.gpusPerNode ? {RANKS.format(r=r)} : self.{r}.gpusPerNode)",
            f"{r}.resources.gpus (per pod) must be 0 (CPU) or the ranks of one pod: {r}.tpSize * {r}.ppSize, or "
            f"{r}.gpusPerNode when an instance spans several nodes (one GPU per rank)",
        )
        for r in names.WORKER_ROLES
    ]
    + [
        (
            "spec",
            f"self.{r}.epSize == 1 || self.{r}.epSize == self.{r}.tpSize",
            f"{r}.epSize must be 1 or equal {r}.tpSize: an instance's tensor ranks share out the experts",
        )
        for r in names.WORKER_ROLES
    ]
    + [
        rule
        for r in names.WORKER_ROLES
        for rule in (
            (
                "spec",
                f"self.{r}.dpSize == 1 || self.{r}.enableDpAttention",
                f"{r}.dpSize above 1 needs {r}.enableDpAttention: it splits an instance's attention into groups; "
                f"whole-model data parallelism is {r}.replicas",
            ),
            (
                "spec",
                f"self.{r}.tpSize % self.{r}.dpSize == 0",
                f"{r}.dpSize must divide {r}.tpSize: each attention group takes tpSize / dpSize of the tensor ranks",
            ),
            (
                "spec",
                f"!self.{r}.enableDpAttention || self.{r}.ppSize == 1",
                f"{r}.enableDpAttention runs on one pipeline stage (ppSize 1)",
            ),
        )
    ]
    + [
        rule
        for r in names.WORKER_ROLES
        for rule in (
            (
                "spec",
                f"{RANKS.format(r=r)} <= self.{r}.gpusPerNode || {RANKS.format(r=r)} % self.{r}.gpusPerNode == 0",
                f"{r}.tpSize * {r}.ppSize above {r}.gpusPerNode must be a multiple of it: an instance that spans "
                "nodes runs gpusPerNode ranks on each",
            ),
            (
                "spec",
                f"{RANKS.format(r=r)} <= self.{r}.gpusPerNode * {MAX_NODES_PER_INSTANCE}",
                f"{r}.tpSize * {r}.ppSize must be at most {MAX_NODES_PER_INSTANCE} x {r}.gpusPerNode: an instance "
                f"spans at most {MAX_NODES_PER_INSTANCE} nodes",
            ),
        )
    ]
)

# Roles whose instances span nodes (LeaderWorkerSets): a role keeps its form, and the model's name leaves room for
# the suffixes LWS adds to its pods' labels.
SPANS = "self.{r}.tpSize * self.{r}.ppSize > self.{r}.gpusPerNode"
SPAN_RULES: list[tuple[str, str, str]] = [
    (
        "spec",
        f"({SPANS.format(r=r)}) == ({SPANS.format(r=r).replace('self.', 'oldSelf.')})",
        f"{r} cannot switch between instances of one node (a StatefulSet) and instances that span nodes (a "
        "LeaderWorkerSet): delete the model and create it again",
    )
    for r in names.WORKER_ROLES
] + [
    (
        "",
        " && ".join(f"!({SPANS.format(r=r).replace('self.', 'self.spec.')})" for r in names.WORKER_ROLES)
        + f" || self.metadata.name.size() <= {names.MAX_NAME_LENGTH_GROUPS}",
        f"metadata.name must be at most {names.MAX_NAME_LENGTH_GROUPS} characters when a role spans nodes: "
        "LeaderWorkerSet's pods carry labels made of it and longer suffixes (at most 63 characters)",
    ),
]
