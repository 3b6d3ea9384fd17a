"""Small builders of OpenAPI v3 (structural) schema nodes, shared by the CRDs in crd.py and scaler_crd.py."""

from typing import Any

# A Kubernetes quantity of bytes as the operator reads it (`quantity.to_bytes`).
QUANTITY = "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"


def integer(default: int | None = None, minimum: int | None = None, doc: str = "", maximum: int | None = None) -> dict:
    s: dict[str, Any] = {"type": "integer"}
    if default is not None:
        s["default"] = default
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    if doc:
        s["description"] = doc
    return s


def string(doc: str = "", max_length: int = 253, **extra: Any) -> dict:
    s: dict[str, Any] = {"type": "string", "maxLength": max_length, **extra}
    if doc:
        s["description"] = doc
    return s


def obj(
    props: dict,
    doc: str = "",
    default: dict | None = None,
    rules: list[dict] | None = None,
    required: list[str] | None = None,
) -> dict:
    s: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        s["required"] = required
    if rules:
        s["x-kubernetes-validations"] = rules
    if default is not None:
        s["default"] = default
    if doc:
        s["description"] = doc
    return s


def free_obj(doc: str) -> dict:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "description": doc}


def rule(expression: str, message: str) -> dict:
    return {"rule": expression, "message": message}


def conditions() -> dict:
    """A list of metav1.Condition-shaped entries keyed by type."""
    condition = obj(
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
    return {
        "type": "array",
        "items": condition,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    }
