"""The DisaggregatedModel CustomResourceDefinition, built here and written to `crds/` by
`python -m disagg_operator.crd`.

Validation that needs no pods lives in the schema: structural types and defaults, plus CEL rules whose messages say
what to change. `RULES` is the list of (where, rule, message) that the API server enforces.
"""

import sys
from typing import Any

import yaml

from . import names
from .spec import DEFAULT_ENGINE

DTYPES = ["float32", "bfloat16", "float16"]


def _int(default: int | None = None, minimum: int | None = None, doc: str = "") -> dict:
    s: dict[str, Any] = {"type": "integer"}
    if default is not None:
        s["default"] = default
    if minimum is not None:
        s["minimum"] = minimum
    if doc:
        s["description"] = doc
    return s


def _str(doc: str = "", max_length: int = 253, **extra: Any) -> dict:
    s: dict[str, Any] = {"type": "string", "maxLength": max_length, **extra}
    if doc:
        s["description"] = doc
    return s


def _obj(
    props: dict, doc: str = "", default: dict | None = None, *, validations: list[dict] | None = None, **extra: Any
) -> dict:
    s: dict[str, Any] = {"type": "object", "properties": props, **extra}
    if validations is not None:
        s["x-kubernetes-validations"] = validations
    if default is not None:
        s["default"] = default
    if doc:
        s["description"] = doc
    return s


def _free_obj(doc: str) -> dict:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "description": doc}


def _rule(rule: str, message: str) -> dict:
    return {"rule": rule, "message": message}


def _engine_props(with_defaults: bool) -> dict:
    d: dict[str, Any] = dict(DEFAULT_ENGINE) if with_defaults else {}
    return {
        "pageSize": _int(d.get("pageSize"), 1, "Tokens per KV page; prefill and decode must agree."),
        "kvDtype": _str(
            "KV cache dtype; prefill and decode must agree.",
            16,
            enum=DTYPES,
            **({"default": d["kvDtype"]} if d else {}),
        ),
        "dtype": _str("Model weights dtype.", 16, enum=DTYPES, **({"default": d["dtype"]} if d else {})),
        "chunkSize": _int(d.get("chunkSize"), 1, "Chunked-prefill size in tokens."),
        "maxTotalTokens": _int(d.get("maxTotalTokens"), 1, "KV cache capacity in tokens."),
        "maxRunningRequests": _int(d.get("maxRunningRequests"), 1, "Requests running at once."),
    }


def _placement_props() -> dict:
    quantities = {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True}}
    return {
        "resources": _obj(
            {
                "requests": quantities,
                "limits": quantities,
                "gpus": _int(0, 0, "GPUs per pod (0 runs on CPU); must equal tpSize * ppSize when set."),
                "rdma": _int(1, 0, "RDMA devices per pod, requested when transfer.protocol is rdma."),
            },
            "Pod resources.",
            default={},
        ),
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": _free_obj("A core/v1 Toleration.")},
        "affinity": _free_obj("A core/v1 Affinity."),
        "env": {"type": "array", "items": {**_free_obj("A core/v1 EnvVar."), "required": ["name"]}},
        "args": {"type": "array", "items": {"type": "string"}, "description": "Extra command-line arguments."},
    }


def _worker_role(role: str) -> dict:
    return _obj(
        {
            "replicas": _int(1, doc=f"Number of {role} pods."),
            "tpSize": _int(1, 1, "Tensor-parallel size."),
            "ppSize": _int(1, 1, "Pipeline-parallel size."),
            "engine": _obj(_engine_props(False), f"Engine settings for {role} only, over spec.engine.", default={}),
            **_placement_props(),
        },
        f"The {role} role.",
        default={},
    )


def _router() -> dict:
    return _obj(
        {
            "replicas": _int(1, doc="Number of router pods."),
            "policy": _str(
                "How the router picks workers.", 32, enum=["round_robin", "least_load"], default="round_robin"
            ),
            **_placement_props(),
        },
        "The router that receives requests and pairs a prefill with a decode worker.",
        default={},
    )


MODEL_RULES = [
    (
        "spec.model",
        "has(self.path) != has(self.huggingFaceId)",
        "set exactly one of model.path (a directory on a volume) and model.huggingFaceId",
    ),
    (
        "spec.model",
        "!has(self.path) || has(self.pvc) || has(self.hostPath)",
        "model.path needs model.pvc or model.hostPath to say which volume holds it",
    ),
    ("spec.model", "!(has(self.pvc) && has(self.hostPath))", "set at most one of model.pvc and model.hostPath"),
    ("spec.model", "self == oldSelf", "model is immutable: create a new DisaggregatedModel to serve another model"),
]

SPEC_RULES = (
    [("spec", f"self.{r}.replicas >= 0", f"{r}.replicas must be 0 or more") for r in names.ROLES]
    + [
        (
            "spec",
            "self.decode.ppSize == self.prefill.ppSize || self.decode.ppSize == 1",
            "decode.ppSize must equal prefill.ppSize or be 1",
        ),
        (
            "spec",
            "self.prefill.tpSize % self.decode.tpSize == 0 || self.decode.tpSize % self.prefill.tpSize == 0",
            "prefill.tpSize and decode.tpSize must divide one another (for example 4 and 2, or 2 and 4)",
        ),
        (
            "spec",
            "(has(self.prefill.engine.pageSize) ? self.prefill.engine.pageSize : self.engine.pageSize) == "
            "(has(self.decode.engine.pageSize) ? self.decode.engine.pageSize : self.engine.pageSize)",
            "prefill and decode must use the same pageSize: KV pages are copied page for page",
        ),
        (
            "spec",
            "(has(self.prefill.engine.kvDtype) ? self.prefill.engine.kvDtype : self.engine.kvDtype) == "
            "(has(self.decode.engine.kvDtype) ? self.decode.engine.kvDtype : self.engine.kvDtype)",
            "prefill and decode must use the same kvDtype: the KV cache is copied byte for byte",
        ),
    ]
    + [
        (
            "spec",
            f"self.{r}.resources.gpus == 0 || self.{r}.resources.gpus == self.{r}.tpSize * self.{r}.ppSize",
            f"{r}.resources.gpus must be 0 (CPU) or {r}.tpSize * {r}.ppSize (one GPU per rank)",
        )
        for r in names.WORKER_ROLES
    ]
    + [
        (
            "spec",
            "self.transfer.protocol != 'rdma' || self.transfer.backend == 'mooncake'",
            "transfer.protocol rdma needs transfer.backend mooncake",
        ),
        (
            "spec",
            "!has(self.transfer.ibDevice) || self.transfer.protocol == 'rdma'",
            "transfer.ibDevice is only used with transfer.protocol rdma",
        ),
    ]
)

IMMUTABLE_RULES = [
    ("spec.servedModelName", "self == oldSelf", "servedModelName is immutable: clients address the model by this name"),
    (
        "spec.transfer",
        "self == oldSelf",
        "transfer is immutable: prefill and decode would have to switch at the same moment",
    ),
]

ROOT_RULES = [
    (
        "",
        f"self.metadata.name.size() <= {names.MAX_NAME_LENGTH}",
        f"metadata.name must be at most {names.MAX_NAME_LENGTH} characters: child objects append -prefill etc.",
    ),
    (
        "",
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "metadata.name must start with a letter and hold only lowercase letters, digits and '-' (it names Services)",
    ),
]

RULES = ROOT_RULES + SPEC_RULES + MODEL_RULES + IMMUTABLE_RULES


def _rules_at(where: str) -> list[dict]:
    return [_rule(rule, msg) for w, rule, msg in RULES if w == where]


def spec_schema() -> dict:
    model = _obj(
        {
            "path": _str("Directory of the model inside the volume (model.pvc or model.hostPath).", 1024),
            "pvc": _str("PersistentVolumeClaim holding model.path, mounted read-only."),
            "hostPath": _str("Node directory holding model.path, mounted read-only.", 1024),
            "huggingFaceId": _str("A Hugging Face model id, downloaded into the cache volume at start-up.", 256),
            "cachePvc": _str("PersistentVolumeClaim for the Hugging Face cache (an emptyDir when absent)."),
        },
        "Where the model weights come from.",
        validations=_rules_at("spec.model"),
    )
    transfer = _obj(
        {
            "backend": _str("KV transfer backend.", 16, enum=["mooncake", "fake"], default="mooncake"),
            "protocol": _str("Transport of the mooncake backend.", 8, enum=["tcp", "rdma"], default="tcp"),
            "ibDevice": _str("InfiniBand device name(s) for rdma, e.g. mlx5_0.", 128),
        },
        "How KV pages move from prefill to decode.",
        default={},
        validations=_rules_at("spec.transfer"),
    )
    return _obj(
        {
            "model": model,
            "servedModelName": _str(
                "The model name clients send in requests.",
                256,
                **{"x-kubernetes-validations": _rules_at("spec.servedModelName")},
            ),
            "image": _str("Worker image (entrypoint `disagg`).", 512),
            "imagePullPolicy": _str("", 16, enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"),
            "engine": _obj(_engine_props(True), "Engine settings shared by prefill and decode.", default={}),
            "transfer": transfer,
            "prefill": _worker_role(names.PREFILL),
            "decode": _worker_role(names.DECODE),
            "router": _router(),
            "auth": _obj(
                {"secretName": _str("Existing Secret with key `token`; generated when absent.")},
                "The model's shared secret (a file in prefill, decode and router pods; never sent as it is).",
                default={},
            ),
            "apiKeySecret": _obj(
                {
                    "name": _str("Secret in the model's namespace."),
                    "key": _str("Key holding the API keys, one a line.", default=names.API_KEY_DEFAULT_KEY),
                },
                "API keys clients must send to the router (Authorization: Bearer); mounted into the router only. "
                "Without it the router takes requests without a key.",
                required=["name"],
            ),
        },
        "The desired state of a disaggregated deployment.",
        required=["model", "servedModelName", "image"],
        validations=_rules_at("spec"),
    )


def _role_status() -> dict:
    return _obj(
        {
            "replicas": _int(),
            "readyReplicas": _int(),
            "updatedReplicas": _int(),
            "ready": {"type": "string", "description": "ready/desired, for printing."},
            "selector": {"type": "string", "description": "Label selector of the role's pods (for an HPA)."},
        }
    )


def status_schema() -> dict:
    condition = _obj(
        {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer"},
        },
        required=["type", "status"],
    )
    return _obj(
        {
            "observedGeneration": _int(),
            "endpoint": {"type": "string", "description": "URL of the router Service inside the cluster."},
            **{role: _role_status() for role in names.ROLES},
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        }
    )


PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "P-READY", "type": "string", "jsonPath": ".status.prefill.ready"},
    {"name": "D-READY", "type": "string", "jsonPath": ".status.decode.ready"},
    {"name": "Router", "type": "string", "jsonPath": ".status.router.ready"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict:
    """The complete CRD manifest."""
    root = _obj(
        {"spec": spec_schema(), "status": status_schema()},
        required=["spec"],
        validations=_rules_at(""),
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names.PLURAL}.{names.GROUP}"},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": [names.SHORT_NAME],
                "listKind": f"{names.KIND}List",
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.decode.replicas",
                            "labelSelectorPath": ".status.decode.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m disagg_operator.crd`; edit operator/disagg_operator/crd.py instead.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
