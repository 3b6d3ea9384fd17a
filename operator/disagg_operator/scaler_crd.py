"""The RoleScaler CustomResourceDefinition: one small object per scalable role with a scale subresource, so that
`kubectl scale` and a HorizontalPodAutoscaler can drive prefill the way the DisaggregatedModel's own scale
subresource drives decode. Written to `crds/` with the DisaggregatedModel CRD by `python -m disagg_operator.crd`.
"""

from . import names
from .schema import integer, obj, rule, string

SCALER_RULES = [
    ("spec.model", "self == oldSelf", "model is immutable: a RoleScaler belongs to one DisaggregatedModel"),
    ("spec.role", "self == oldSelf", "role is immutable: a RoleScaler scales one role"),
]

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _rules_at(where: str) -> list[dict]:
    return [rule(expression, msg) for w, expression, msg in SCALER_RULES if w == where]


def build_scaler_crd() -> dict:
    spec = obj(
        {
            "model": string("The DisaggregatedModel whose role this scales.", 253, **_validations("spec.model")),
            "role": string("The role it scales.", 16, enum=[names.PREFILL], **_validations("spec.role")),
            "replicas": integer(minimum=0, doc="Desired pods of the role."),
        },
        "Which role of which model, and how many pods it should have.",
        required=["model", "role", "replicas"],
    )
    status = obj(
        {
            "replicas": integer(doc="Pods the role's StatefulSet has."),
            "selector": {"type": "string", "description": "Label selector of the role's pods (for an HPA)."},
            "observedGeneration": integer(doc="The generation whose replicas the operator has handed on."),
        }
    )
    root = obj({"spec": spec, "status": status}, required=["spec"])
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names.SCALER_PLURAL}.{names.GROUP}"},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.SCALER_KIND,
                "plural": names.SCALER_PLURAL,
                "singular": names.SCALER_SINGULAR,
                "listKind": f"{names.SCALER_KIND}List",
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
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def _validations(where: str) -> dict:
    return {"x-kubernetes-validations": _rules_at(where)}
