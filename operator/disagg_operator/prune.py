"""Deleting the children a change of the spec retired (the store's, when `spec.kvCache.store` goes).

Server-side apply never removes an object, so what the spec no longer asks for is deleted here: only an object this
model made (an owner reference to it; anything else of the name is left alone), and each name is looked up once
until the model asks for it again, so a model that never had a store costs one read per name per operator start.
"""

from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from .apply import Kube
from .apply_errors import ReconcileError, owned_by
from .model_state import Child
from .spec import ModelSpec


def prune(
    kube: Kube, spec: ModelSpec, retired: Iterable[Mapping[str, Any]], gone: set[Child], owned: set[Child]
) -> list[str]:
    """Delete each of `retired` that exists and is this model's; `gone` holds the model's names known to be absent
    (and gains these), `owned` loses them (both the model's own, model_state.py). Returns what was deleted, as
    `Kind/name`."""
    deleted = []
    for obj in retired:
        kind, name = obj["kind"], obj["metadata"]["name"]
        key = (kind, name)
        if key in gone:
            continue
        try:
            found = kube.get(obj["apiVersion"], kind, spec.namespace, name)
            if found is not None and owned_by(found, spec):
                kube.delete(obj["apiVersion"], kind, spec.namespace, name)
                deleted.append(f"{kind}/{name}")
        except ApiException as e:
            raise ReconcileError(f"deleting {kind} {name} failed ({e.status} {e.reason})", permanent=False) from e
        gone.add(key)
        owned.discard(key)
    return deleted
