"""What applying a model's children can fail with, told as a user can act on it: an object of the model's name that
another owner holds, an API the cluster lacks (LeaderWorkerSet, InferencePool, HTTPRoute), a refused write."""

from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import names
from .spec import ModelSpec


class ReconcileError(Exception):
    """A failure a user must fix (`permanent`) or one worth retrying."""

    def __init__(self, message: str, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


LWS_MISSING = (
    "LeaderWorkerSet is not installed in this cluster: a role whose instances span nodes (tpSize * ppSize above "
    "gpusPerNode) runs as one; install LWS (sigs.k8s.io/lws, see the chart's README) or fit each instance on a node"
)

# The CRDs `spec.gateway` needs, by the kind whose apply fails with 404 where its API is not served.
GATEWAY_CRDS = {
    names.POOL_KIND: (
        f"{names.POOL_PLURAL}.{names.INFERENCE_GROUP}",
        "the Gateway API Inference Extension's; the chart's gateway.installInferencePoolCRD installs it",
    ),
    names.ROUTE_KIND: (f"{names.ROUTE_PLURAL}.{names.GATEWAY_GROUP}", "the Gateway API's standard channel"),
}


def crd_missing(kind: str) -> str:
    crd, source = GATEWAY_CRDS[kind]
    return (
        f"{kind} is not installed in this cluster: spec.gateway needs the CRD {crd} ({source}); the model serves "
        "through its router meanwhile"
    )


def owned_by(obj: Mapping[str, Any], spec: ModelSpec) -> bool:
    """Whether the operator made `obj` for this model: an owner reference to this CR. (What an earlier CR of the
    same name owned is the garbage collector's to remove; until it has, the new one reports it.)"""
    return any(r.get("uid") == spec.uid for r in obj.get("metadata", {}).get("ownerReferences") or [])


def not_ours(objs: list[Mapping[str, Any]]) -> ReconcileError:
    what = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objs)
    one = len(objs) == 1
    return ReconcileError(
        f"{what} already exist{'s' if one else ''} and {'was' if one else 'were'} not created by this model (no "
        f"owner reference to it): left untouched; delete or rename {'it' if one else 'them'}, or rename the model",
        permanent=False,
    )


def describe_api_error(obj: Mapping[str, Any], e: ApiException) -> ReconcileError:
    what = f"{obj['kind']} {obj['metadata']['name']}"
    if obj["kind"] == names.LWS_KIND and e.status == 404:  # the API itself is absent, not the object
        return ReconcileError(LWS_MISSING, permanent=False)
    if obj["kind"] in GATEWAY_CRDS and e.status == 404:
        return ReconcileError(crd_missing(obj["kind"]), permanent=False)
    permanent = e.status in (400, 403, 422)
    return ReconcileError(f"applying {what} failed ({e.status} {e.reason})", permanent)
