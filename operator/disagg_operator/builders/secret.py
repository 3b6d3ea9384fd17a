"""The generated auth Secret (only when the CR names no Secret of its own)."""

import base64
import secrets
from typing import Any

from .. import names
from ..spec import ModelSpec
from .common import metadata


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
