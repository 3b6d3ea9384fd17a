"""Secrets: the generated auth Secret (only when the CR names no Secret of its own), and how Secrets reach pods.

Secrets are mounted as read-only files, never put in the environment, and only into the pods that use them:
the model's shared secret into prefill, decode and router (the bootstrap token, the router-to-worker token
and the key that signs bootstrap targets are all derived from it); the clients' API keys into the router only.
"""

import base64
import secrets
from typing import Any

from .. import names
from ..spec import ModelSpec, SecretRef
from .common import metadata

# Readable by the owner and the pod's group (fsGroup), nobody else.
SECRET_FILE_MODE = 0o440


def new_token() -> str:
    return secrets.token_urlsafe(32)


def build_auth_secret(spec: ModelSpec, token: str) -> dict[str, Any]:
    """The Secret holding the shared token; created once and never rewritten, so the token is stable."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(spec, names.auth_secret_name(spec.name), "auth"),
        "data": {names.AUTH_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _secret_volume(name: str, secret: str, key: str, mount: str, file: str) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {
        "name": name,
        "secret": {"secretName": secret, "items": [{"key": key, "path": file}], "defaultMode": SECRET_FILE_MODE},
    }
    return volume, {"name": name, "mountPath": mount, "readOnly": True}


def auth_token_file() -> str:
    """Where pods find the model's shared secret (`--auth-token-file`)."""
    return f"{names.AUTH_MOUNT}/{names.AUTH_TOKEN_KEY}"


def auth_volume(spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's shared secret as a file (prefill, decode and router pods)."""
    return _secret_volume("auth", spec.auth_secret_name, names.AUTH_TOKEN_KEY, names.AUTH_MOUNT, names.AUTH_TOKEN_KEY)


def api_keys_file() -> str:
    """Where the router (and, behind a gateway, the decode pods) find the clients' API keys (`--api-key-file`)."""
    return f"{names.API_KEYS_MOUNT}/keys"


def api_keys_volume(ref: SecretRef) -> tuple[dict[str, Any], dict[str, Any]]:
    """The clients' API keys as a file (router pods, and decode pods behind a gateway)."""
    return _secret_volume("api-keys", ref.name, ref.key, names.API_KEYS_MOUNT, "keys")
