"""What the router holds to authenticate its clients, itself to the workers, and the targets it names.

- Clients present one of the API keys (`--api-key`, `--api-key-file`; `server.auth`). With keys set, the
  detailed /health (worker addresses, pod names, pair errors), and /ready's reason naming the failing pairs, are
  shown only to a key holder or to the operator (its key derived from the shared secret, `keys.HEALTH`); others get
  the plain status.
- Every call to a worker carries the worker token derived from the model's shared secret
  (`--auth-token-file`, `keys.WORKER`).
- Every request it routes names a bootstrap target (the prefill instance that holds the KV) with
  its signature (`keys.TARGET`): decode contacts no host without one, so a caller who reaches a
  worker cannot make it hand anything to a host of its choosing.
- The cache-aware policy names a prompt's pages with the key the workers name their cached pages with
  (`keys.kv_names`).
Without a shared secret (local runs) workers take unsigned targets and no worker token, and pages are named
unkeyed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from disagg_worker import keys
from disagg_worker.http.auth import authorized
from disagg_worker.request import route


@dataclass(frozen=True)
class RouterAuth:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    worker_token: str = field(default="", repr=False)
    target_key: str = field(default="", repr=False)
    kv_key: bytes = field(default=b"", repr=False)
    kv_key_id: str = ""
    health_token: str = field(default="", repr=False)  # the operator's key to the detailed /health (`keys.HEALTH`)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> RouterAuth:
        """Read the keys at start-up; a key asked for but empty raises `keys.SecretError`."""
        secret = keys.read_secret(ns.auth_token_file, "--auth-token-file") if ns.auth_token_file else ""
        kv_key, kv_key_id = keys.kv_names(secret)
        return cls(
            api_keys=keys.read_api_keys(ns.api_key, ns.api_key_file),
            worker_token=keys.derive(secret, keys.WORKER) if secret else "",
            target_key=keys.derive(secret, keys.TARGET) if secret else "",
            kv_key=kv_key,
            kv_key_id=kv_key_id,
            health_token=keys.derive(secret, keys.HEALTH) if secret else "",
        )

    def shows_health_details(self, authorization: str) -> bool:
        """Whether /health may list workers and pairs to this caller: always without API keys; with them, to a
        caller presenting one, or the operator's health token."""
        if not self.api_keys:
            return True
        accepted = [k.encode() for k in (*self.api_keys, self.health_token) if k]
        return authorized(authorization, tuple(accepted))

    def worker_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.worker_token}"} if self.worker_token else {}

    def target(self, host: str, port: int, room: int, dp_rank: int | None = None) -> dict:
        """The bootstrap fields of one routed request, signed when the model has a secret."""
        return route.target_fields(self.target_key, host, port, room, dp_rank)

    def local_prefill(self) -> dict:
        """The fields of a request decode computes itself, signed when the model has a secret."""
        return route.local_prefill_fields(self.target_key)
