"""What the operator presents to a router's /health.

With API keys set, a router shows its detailed /health (workers, pairs, hand-off counters: what the
operator turns into conditions) only to a caller holding a key; everyone else, the kubelet's probes
included, gets the plain status. The operator holds the model's shared secret (it generated it, or the
user named it) and presents the key derived from it for this one purpose, as the worker derives it
(`disagg_worker.keys.HEALTH`: HMAC-SHA256(secret, purpose), hex). The secret is read once per Secret.
"""

import base64
import hashlib
import hmac
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from . import names
from .spec import ModelSpec

log = logging.getLogger(__name__)
HEALTH = "router-health"  # the purpose; equal to disagg_worker.keys.HEALTH (a test holds them together)


def health_token(secret: str) -> str:
    return hmac.new(secret.encode(), HEALTH.encode(), hashlib.sha256).hexdigest()


class SecretReader(Protocol):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None: ...


class ProbeTokens:
    """uid -> the bearer token for that CR's routers, read from its auth Secret on first use."""

    def __init__(self, kube: SecretReader):
        self.kube = kube
        self._tokens: dict[tuple[str, str], str] = {}

    def for_crs(self, crs: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
        """uid -> token of every CR in `crs` (uid -> CR) whose Secret could be read."""
        out = {}
        for uid, cr in crs.items():
            token = self._token(ModelSpec.from_cr(cr))
            if token:
                out[uid] = token
        return out

    def forget(self, cr: Mapping[str, Any]) -> None:
        """A router hid its details from this CR's token (the Secret changed): read the Secret again next time."""
        spec = ModelSpec.from_cr(cr)
        self._tokens.pop((spec.namespace, spec.auth_secret_name), None)

    def _token(self, spec: ModelSpec) -> str:
        key = (spec.namespace, spec.auth_secret_name)
        if key not in self._tokens:
            try:
                secret = self.kube.get("v1", "Secret", spec.namespace, spec.auth_secret_name) or {}
            except ApiException as e:
                log.warning("reading Secret %s/%s failed (%s)", *key, e.status)
                return ""
            data = (secret.get("data") or {}).get(names.AUTH_TOKEN_KEY)
            if not data:
                return ""
            self._tokens[key] = health_token(base64.b64decode(data).decode().strip())
        return self._tokens[key]
