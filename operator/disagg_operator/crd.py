"""The DisaggregatedModel CustomResourceDefinition, built here; `python -m disagg_operator.crd crds
charts/disagg-operator/crds` writes it and the RoleScaler CRD (scaler_crd.py) into both directories.

Validation that needs no pods lives in the schema: structural types and defaults, plus CEL rules whose messages say
what to change. `RULES` is the list of (where, rule, message) that the API server enforces.
"""

import sys
from pathlib import Path

import yaml

from disagg_api import settings as S

from . import names
from .crd_flow import FLOW_RULES
from .crd_gateway import GATEWAY_RULES, gateway_schema
from .crd_kvcache import KV_CACHE_RULES, kv_cache_schema
from .crd_lora import LORA_RULES, lora_schema
from .crd_planner import PLANNER_RULES, planner_schema, slo_schema
from .crd_roles import ATTN_TP, RANK_RULES, SPAN_RULES, engine_props, router_schema, tracing_schema, worker_role_schema
from .crd_speculative import SPECULATIVE_RULES, speculative_schema
from .crd_status import status_schema
from .schema import QUANTITY, integer, obj, rule, string
from .spec import DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_SURGE, DEFAULT_PROGRESS_DEADLINE, ORDERS

# What names the model a CR serves; the rest of spec.model says where a download is kept.
IDENTITY = ("path", "pvc", "hostPath", "huggingFaceId", "builtin")
MODEL_RULES = [
    (
        "spec.model",
        "[has(self.path), has(self.huggingFaceId), has(self.builtin)].filter(x, x).size() == 1",
        "set exactly one of model.path (a directory on a volume), model.huggingFaceId and model.builtin",
    ),
    (
        "spec.model",
        "!has(self.builtin) || [has(self.pvc), has(self.hostPath), has(self.cachePvc)].all(x, !x)",
        "model.builtin is inside the worker image: it takes no model.pvc, model.hostPath or model.cachePvc",
    ),
    (
        "spec.model",
        "!has(self.path) || has(self.pvc) || has(self.hostPath)",
        "model.path needs model.pvc or model.hostPath to say which volume holds it",
    ),
    ("spec.model", "!(has(self.pvc) && has(self.hostPath))", "set at most one of model.pvc and model.hostPath"),
    (
        "spec.model",
        "!has(self.cacheSize) || (has(self.huggingFaceId) && !has(self.cachePvc))",
        "model.cacheSize sizes the download cache emptyDir: it needs model.huggingFaceId and no model.cachePvc",
    ),
    (
        "spec.model",
        " && ".join(f"(has(self.{f}) ? self.{f} : '') == (has(oldSelf.{f}) ? oldSelf.{f} : '')" for f in IDENTITY),
        "model is immutable (path, pvc, hostPath, huggingFaceId, builtin; the download cache may change): create a new "
        "DisaggregatedModel to serve another model",
    ),
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
            f"{ATTN_TP.format(r='prefill')} % {ATTN_TP.format(r='decode')} == 0 || "
            f"{ATTN_TP.format(r='decode')} % {ATTN_TP.format(r='prefill')} == 0",
            "prefill.tpSize and decode.tpSize (each divided by its dpSize under DP attention: the KV heads of one "
            "attention group) must divide one another (for example 4 and 2, or 2 and 4)",
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
    + RANK_RULES
    + [
        (
            "spec",
            "self.router.policy != 'cache_aware' || !has(self.model.huggingFaceId)",
            "router.policy cache_aware reads the model's tokenizer from its files: the model must be on a volume "
            "(model.path) or built in (model.builtin), not downloaded (model.huggingFaceId)",
        ),
        (
            "spec",
            "self.router.decodeOnlyTokens == 0 || self.router.policy == 'cache_aware'",
            "router.decodeOnlyTokens needs router.policy cache_aware: the router must read the prompts to count the "
            "tokens a decode lacks",
        ),
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
    (
        "spec.transfer",
        "self == oldSelf",
        "transfer is immutable: prefill and decode would have to switch at the same moment",
    ),
]

SERVED_NAME = "(has({0}.spec.servedModelName) ? {0}.spec.servedModelName : {0}.metadata.name)"

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
    (
        "",
        f"{SERVED_NAME.format('self')} == {SERVED_NAME.format('oldSelf')}",
        "servedModelName is immutable (it defaults to metadata.name): clients address the model by this name",
    ),
]

RULES = ROOT_RULES + SPEC_RULES + MODEL_RULES + SPECULATIVE_RULES + IMMUTABLE_RULES + SPAN_RULES + KV_CACHE_RULES
RULES += PLANNER_RULES + GATEWAY_RULES + FLOW_RULES + LORA_RULES


def _rules_at(where: str) -> list[dict]:
    return [rule(expression, msg) for w, expression, msg in RULES if w == where]


def _drain() -> dict:
    timeout = integer(
        DEFAULT_DRAIN_TIMEOUT,
        0,
        "Seconds a stopping pod may spend finishing its requests (`--drain-timeout`); the pods' "
        "terminationGracePeriodSeconds adds the preStop pause and an exit margin.",
        3600,
    )
    return obj(
        {"timeoutSeconds": timeout},
        "Graceful shutdown of workers and routers (scale-down, rollout, eviction).",
        default={},
    )


def _rollout() -> dict:
    return obj(
        {
            "order": string(
                "Which role a change touching both roles updates first.", 16, enum=list(ORDERS), default="DecodeFirst"
            ),
            "maxSkew": string(
                "Largest difference between the updated fractions of prefill and decode, e.g. '50%'; "
                "default (and lower bound): one pod's worth of the smaller role.",
                4,
                pattern="^(100|[1-9][0-9]?)%$",
            ),
            "progressDeadlineSeconds": integer(
                DEFAULT_PROGRESS_DEADLINE, 1, "A rollout without progress for this long is reported as stalled."
            ),
            "minReadySeconds": integer(0, 0, "Seconds a new pod must stay Ready before the rollout moves on."),
            "maxSurge": integer(
                DEFAULT_MAX_SURGE,
                0,
                "Pods per role started on the new template beside the old ones before any old pod leaves, so a "
                "new pair serves while the old pods drain; 0 replaces pods in place (no spare capacity needed). "
                "Surge pods that cannot be scheduled within progressDeadlineSeconds fall back to in place.",
            ),
        },
        "Rollout of prefill and decode: beside the old pods (maxSurge) or in place, in a coordinated order.",
        default={},
    )


def _scaling() -> dict:
    ratio = {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 64,
        "description": "Prefill pods per decode pod: prefill follows decode's replicas (rounded up, at least one), "
        "so one autoscaler on decode scales both; prefill.replicas is then ignored.",
    }
    props = {"prefillPerDecode": ratio, "slo": slo_schema(), "planner": planner_schema()}
    return obj(props, "Scaling of the roles.", default={}, rules=_rules_at("spec.scaling"))


def spec_schema() -> dict:
    model = obj(
        {
            "path": string("Directory of the model inside the volume (model.pvc or model.hostPath).", 1024),
            "pvc": string("PersistentVolumeClaim holding model.path, mounted read-only."),
            "hostPath": string("Node directory holding model.path, mounted read-only.", 1024),
            "huggingFaceId": string("A Hugging Face model id, downloaded into the cache volume at start-up.", 256),
            "builtin": string(
                "A model built into the worker image, served without a volume: smollm2 (SmolLM2-135M-Instruct, "
                "at /opt/models/SmolLM2-135M-Instruct in images built from Dockerfile.worker).",
                32,
                enum=sorted(names.BUILTIN_MODELS),
            ),
            "cachePvc": string("PersistentVolumeClaim for the Hugging Face cache (an emptyDir when absent)."),
            "cacheSize": string(
                "Size of the Hugging Face cache emptyDir (its sizeLimit, requested as ephemeral storage); "
                "default: from the parameter count the id names (2.5 bytes each), else unbounded (with a warning).",
                16,
                pattern=QUANTITY,
            ),
        },
        "Where the model weights come from.",
        rules=_rules_at("spec.model"),
    )
    transfer = obj(
        {
            "backend": string("KV transfer backend.", 16, enum=list(S.TRANSFER_BACKENDS), default="mooncake"),
            "protocol": string("Transport of the mooncake backend.", 8, enum=list(S.TRANSFER_PROTOCOLS), default="tcp"),
            "ibDevice": string("InfiniBand device name(s) for rdma, e.g. mlx5_0.", 128),
        },
        "How KV pages move from prefill to decode.",
        default={},
        rules=_rules_at("spec.transfer"),
    )
    return obj(
        {
            "model": model,
            "servedModelName": string("The model name clients send in requests (default: metadata.name).", 256),
            "image": string("Worker image (entrypoint `disagg`).", 512),
            "imagePullPolicy": string("", 16, enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"),
            "engine": obj(engine_props(True), "Engine settings shared by prefill and decode.", default={}),
            "transfer": transfer,
            "prefill": worker_role_schema(names.PREFILL),
            "decode": worker_role_schema(names.DECODE),
            "router": router_schema(),
            "auth": obj(
                {"secretName": string("Existing Secret with key `token`; generated when absent.")},
                "The model's shared secret (a file in prefill, decode and router pods; never sent as it is).",
                default={},
            ),
            "apiKeySecret": obj(
                {
                    "name": string("Secret in the model's namespace."),
                    "key": string("Key holding the API keys, one a line.", default=names.API_KEY_DEFAULT_KEY),
                },
                "API keys clients must send to the router (Authorization: Bearer); mounted into the router only. "
                "Without it the router takes requests without a key.",
                required=["name"],
            ),
            "drain": _drain(),
            "rollout": _rollout(),
            "scaling": _scaling(),
            "speculative": speculative_schema(),
            "tracing": tracing_schema(),
            "kvCache": kv_cache_schema(),
            "gateway": gateway_schema(),
            "lora": lora_schema(),
        },
        "The desired state of a disaggregated deployment.",
        required=["model", "image"],
        rules=_rules_at("spec"),
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
    root = obj({"spec": spec_schema(), "status": status_schema()}, required=["spec"], rules=_rules_at(""))
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


def render(crd: dict | None = None) -> str:
    header = "# Generated by `python -m disagg_operator.crd`; edit operator/disagg_operator/crd.py instead.\n"
    return header + yaml.safe_dump(crd or build_crd(), sort_keys=False, width=120)


def files() -> dict[str, str]:
    """Every CRD this project ships, by file name (crds/ and the chart's crds/ hold identical copies)."""
    from .scaler_crd import build_scaler_crd

    return {
        f"{names.GROUP}_{names.PLURAL}.yaml": render(),
        f"{names.GROUP}_{names.SCALER_PLURAL}.yaml": render(build_scaler_crd()),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1:  # python -m disagg_operator.crd DIR...: write every CRD file into each DIR
        for directory in sys.argv[1:]:
            for name, text in files().items():
                (Path(directory) / name).write_text(text)
    else:
        sys.stdout.write(render())
