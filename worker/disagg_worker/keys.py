"""Secrets read at start-up, and the keys derived from a model's shared secret.

API keys (`--api-key`, `--api-key-file`) are what clients present to a router or a monolithic
server. The model's shared secret (`--auth-token-file`, a Secret the operator generates and mounts
as a file into the prefill, decode and router pods) is never sent anywhere as it is: each use gets
its own key, HMAC-SHA256(secret, purpose), so that a key one party sees is worth nothing for
another purpose:
- `BOOTSTRAP`: the bootstrap server's bearer token (prefill ranks register, decode asks where a
  rank is); decode sends it only to prefill instances the router vouched for.
- `WORKER`: the bearer token the router presents to worker HTTP ports.
- `HEALTH`: with API keys set, what the operator presents to see a router's detailed `/health` (workers,
  pairs); without a key, a caller gets the plain status (the kubelet's probes need no more).
- `TARGET`: the key of the router's signature over a request's bootstrap target (host, port,
  room); decode contacts no prefill instance without a valid one.
- `CONTROL`: the key of the HMAC on every frame of the KV control channel between prefill and decode ranks
  (`disagg/channel.py`): a frame without a valid one is dropped, so only the model's own ranks steer a room.
- `KV_NAMES`: the key of the names of cached pages (`mem/kv_events.py`), so that whoever reads an instance's
  `/kv_events` cannot tell whether a prompt they guess is cached; `KV_NAMES_ID` names that key in each answer
  (a router keyed otherwise flags the instance instead of missing every page).
- `STORE_TAGS`: the key of the integrity tag on every page kept in Mooncake Store (`mem/page_tag.py`): a page
  changed in the store, or written there by anyone without the secret, fails it and is computed again.

A secret or key that is asked for but empty is an error at start-up, never "no authentication".
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

BOOTSTRAP = "bootstrap"
WORKER = "worker-http"
HEALTH = "router-health"
TARGET = "bootstrap-target"
CONTROL = "kv-control-frames"
KV_NAMES = "kv-page-names"
KV_NAMES_ID = "kv-page-names-id"
STORE_TAGS = "kv-store-page-tags"


class SecretError(ValueError):
    """A secret was asked for but cannot be read, or is empty."""


def read_secret(path: str, flag: str) -> str:
    """The stripped content of the file `path` names (given with `flag`)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SecretError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    secret = text.strip()
    if not secret:
        raise SecretError(f"{flag} {path} is empty: authentication was asked for, so start-up stops here")
    return secret


def read_api_keys(key: str | None, key_file: str) -> tuple[str, ...]:
    """The API keys of `--api-key` and `--api-key-file` (one a line, blank lines skipped); () when
    neither flag was given."""
    out: list[str] = []
    if key is not None:
        if not key.strip():
            raise SecretError("--api-key is empty: authentication was asked for, so start-up stops here")
        out.append(key.strip())
    if key_file:
        out += [line.strip() for line in read_secret(key_file, "--api-key-file").splitlines() if line.strip()]
    return tuple(out)


def derive(secret: str, purpose: str) -> str:
    """The key for `purpose` (hex), derived from the model's shared secret."""
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def control_key(secret: str) -> bytes:
    """The key of the control channel's frames; without a secret a fixed one (frames are then checked for
    integrity, not origin: such an instance listens on loopback only, `disagg.mooncake.environ`)."""
    return bytes.fromhex(derive(secret or "no-secret", CONTROL))


def store_tag_key(secret: str) -> bytes:
    """The key of the tags on the store's pages; without a secret a fixed one (a tag then catches corruption, not
    forgery: anyone can compute it)."""
    return bytes.fromhex(derive(secret or "no-secret", STORE_TAGS))


def _target(host: str, port: int, room: int) -> bytes:
    return f"{host}\n{port}\n{room}".encode()


def sign_target(key: str, host: str, port: int, room: int) -> str:
    """The router's signature over a bootstrap target (hex)."""
    return hmac.new(key.encode(), _target(host, port, room), hashlib.sha256).hexdigest()


# The "target" the router signs on a request decode computes itself (`local_prefill`): no host is contacted, but
# only the router may send one (a client reaching decode directly would skip the router's admission).
LOCAL_PREFILL = "local_prefill"


def target_signed(key: str, host: str, port: int, room: int, signature: str) -> bool:
    """Whether `signature` is the router's over this target (constant time)."""
    return hmac.compare_digest(sign_target(key, host, port, room), signature)


def kv_names(secret: str) -> tuple[bytes, str]:
    """The key of the cached pages' names and the id an instance publishes with them ((b"", "") without a
    secret: names are then plain hashes of the tokens)."""
    if not secret:
        return b"", ""
    return bytes.fromhex(derive(secret, KV_NAMES)), derive(secret, KV_NAMES_ID)[:16]
