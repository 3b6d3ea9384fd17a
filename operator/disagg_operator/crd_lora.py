"""Schema of `spec.lora`: the LoRA adapters both roles serve (their `--lora-modules`, `--max-loras`,
`--max-lora-rank`; docs/lora.md), and its CEL rules. Composed into the spec by crd.py."""

from disagg_api import settings as S

from . import names
from .schema import integer, obj, rule, string

LORA = "spec.lora"
ADAPTER = "spec.lora.adapters[]"
# An adapter's name: what requests put in `model`, and a directory name under /lora in the pods.
ADAPTER_NAME = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MAX_ADAPTERS = 64
MAX_RANK = 512
SERVED_NAME = "(has(self.spec.servedModelName) ? self.spec.servedModelName : self.metadata.name)"

# (where, rule, message) checked by the API server, as crd.RULES.
LORA_RULES: list[tuple[str, str, str]] = [
    (
        ADAPTER,
        "(has(self.configMap) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) == 1",
        "lora.adapters[]: set exactly one of configMap, pvc and hostPath (where the adapter's directory is)",
    ),
    (
        ADAPTER,
        "has(self.pvc) || !has(self.path)",
        "lora.adapters[].path is a directory inside the adapter's pvc: it needs pvc",
    ),
    (
        ADAPTER,
        "!has(self.path) || !self.path.matches('(^|/)[.][.](/|$)')",
        "lora.adapters[].path must stay inside the PVC: no '..'",
    ),
    (
        LORA,
        "self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
        "lora.adapters must name each adapter once: a request's model names one",
    ),
    (
        "",
        f"!has(self.spec.lora) || self.spec.lora.adapters.all(a, a.name != {SERVED_NAME})",
        "lora.adapters[].name must differ from servedModelName (default: metadata.name): requests for that name "
        "run the base model",
    ),
    (
        "spec",
        "!has(self.lora) || (self.prefill.tpSize == 1 && self.prefill.ppSize == 1 && self.prefill.dpSize == 1 && "
        "self.decode.tpSize == 1 && self.decode.ppSize == 1 && self.decode.dpSize == 1)",
        "lora serves adapters on single-rank instances for now: prefill and decode need tpSize, ppSize and dpSize 1",
    ),
]


def _rules_at(where: str) -> list[dict]:
    return [rule(expression, message) for w, expression, message in LORA_RULES if w == where]


def lora_schema() -> dict:
    adapter = obj(
        {
            "name": string(
                "The adapter's name: requests select it by `model`, /v1/models lists it with the served model as its "
                f"parent. Mounted at {names.LORA_MOUNT}/NAME.",
                63,
                pattern=ADAPTER_NAME,
            ),
            "configMap": string(
                "A ConfigMap holding the adapter's files: adapter_config.json (data) and adapter_model.safetensors "
                "(binaryData), at most 1 MiB in all."
            ),
            "pvc": string("A PersistentVolumeClaim holding the adapter's directory (at path), mounted read-only."),
            "path": string("The adapter's directory inside pvc (default: its root).", 1024),
            "hostPath": string("A node directory holding the adapter's files, mounted read-only.", 1024),
        },
        "One adapter in PEFT's format (adapter_config.json and adapter_model.safetensors).",
        required=["name"],
        rules=_rules_at(ADAPTER),
    )
    return obj(
        {
            "adapters": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_ADAPTERS,
                "items": adapter,
                "description": "The adapters, loaded by every prefill and decode pod at start-up (`--lora-modules`): "
                "a pod that cannot load one fails its start-up naming it, so the model is Ready only once both roles "
                "serve them all.",
            },
            "maxLoras": integer(
                S.MAX_LORAS.default,
                1,
                "Adapters resident at once per pod (`--max-loras`); the requests of the others wait for a slot.",
                MAX_ADAPTERS,
            ),
            "maxLoraRank": integer(
                S.MAX_LORA_RANK.default,
                1,
                "The largest rank r an adapter may have (`--max-lora-rank`).",
                MAX_RANK,
            ),
        },
        "LoRA adapters served beside the base model, the same on prefill and decode (docs/lora.md). Single-rank "
        "roles only (tpSize, ppSize, dpSize 1).",
        required=["adapters"],
        rules=_rules_at(LORA),
    )
