"""A thin client for the few API calls the operator makes: server-side apply, create-once, read, status patch,
and deleting a child the spec retired.

Every call is counted by verb so a benchmark (or a test) can say how many writes a reconcile costs.
"""

import collections
import json
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from . import names

PLURALS = {
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "Service": "services",
    "Secret": "secrets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    names.KIND: names.PLURAL,
    names.SCALER_KIND: names.SCALER_PLURAL,
    names.LWS_KIND: names.LWS_PLURAL,
    "ServiceAccount": "serviceaccounts",
    names.POOL_KIND: names.POOL_PLURAL,
    names.ROUTE_KIND: names.ROUTE_PLURAL,
}
WRITE_VERBS = ("apply", "create", "patch", "patch_status", "delete")


def object_path(api_version: str, plural: str, namespace: str, name: str = "") -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def load_client(pool_size: int = 32) -> client.ApiClient:
    """In a pod, the ServiceAccount's identity; elsewhere, the kubeconfig (KUBECONFIG or ~/.kube/config).

    `pool_size` keeps one connection per handler thread, so concurrent reconciles do not reconnect.
    """
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = pool_size
    return client.ApiClient(cfg)


class Kube:
    """The operator's API calls. Thread-safe: kopf runs sync handlers in a thread pool."""

    def __init__(self, api: client.ApiClient):
        self.api = api
        self._lock = threading.Lock()
        self.calls: collections.Counter[str] = collections.Counter()

    def _call(
        self,
        verb: str,
        method: str,
        path: str,
        body: Any = None,
        query: list | None = None,
        content_type: str = "application/json",
    ) -> Any:
        with self._lock:
            self.calls[verb] += 1
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        method, url, headers, body, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        resp = self.api.call_api(method, url, header_params=headers, body=body)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason, body=data)
        return json.loads(data) if data else None

    @property
    def writes(self) -> int:
        return sum(self.calls[v] for v in WRITE_VERBS)

    def apply(self, obj: Mapping[str, Any]) -> Any:
        """Server-side apply `obj` as the operator's field manager, taking over conflicting fields."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"], meta["name"])
        query = [("fieldManager", names.FIELD_MANAGER), ("force", "true")]
        return self._call("apply", "PATCH", path, json.dumps(obj), query, "application/apply-patch+yaml")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return self._call("get", "GET", object_path(api_version, PLURALS[kind], namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, plural: str, namespace: str) -> dict:
        """A namespace's objects of one kind (a plain GET of the collection)."""
        return self._call("list", "GET", object_path(api_version, plural, namespace)) or {}

    def create_if_absent(self, obj: Mapping[str, Any]) -> bool:
        """Create `obj` unless an object of that name exists; True when it was created here."""
        meta = obj["metadata"]
        if self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) is not None:
            return False
        try:
            self._call(
                "create", "POST", object_path(obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"]), dict(obj)
            )
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete the object (its dependents in the background); False when it was not there."""
        path = object_path(api_version, PLURALS[kind], namespace, name)
        try:
            self._call("delete", "DELETE", path, {"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any], kind: str = names.KIND) -> Any:
        """Merge-patch the status subresource (a field set to None is removed)."""
        path = object_path(names.API_VERSION, PLURALS[kind], namespace, name) + "/status"
        return self._call(
            "patch_status", "PATCH", path, {"status": dict(status)}, content_type="application/merge-patch+json"
        )

    def patch(self, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> Any:
        """Merge-patch one of the operator's own kinds: fields it writes without owning them (replicas)."""
        path = object_path(names.API_VERSION, PLURALS[kind], namespace, name)
        return self._call("patch", "PATCH", path, dict(body), content_type="application/merge-patch+json")
