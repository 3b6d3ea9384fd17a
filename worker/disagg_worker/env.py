"""Every environment variable the worker reads, in one typed place (prefix `DISAGG_`).

Read once at start-up with `load_env()`; pass the values down instead of reading
`os.environ` elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "DISAGG_"


@dataclass(frozen=True)
class WorkerEnv:
    # Bearer token for the bootstrap server ("" disables auth). Both ends must agree.
    auth_token: str = ""
    # The pod's name (Kubernetes downward API); reported on /health so routers and the operator can name it.
    pod_name: str = ""
    # Pairing revision of this instance (the pod's `disagg.dev/revision` label): the router pairs a prefill
    # only with a decode of the same revision, so a rollout never mixes incompatible halves. "" outside Kubernetes.
    revision: str = ""


def load_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    env = os.environ if environ is None else environ
    return WorkerEnv(
        auth_token=env.get(f"{PREFIX}AUTH_TOKEN", "").strip(),
        pod_name=env.get(f"{PREFIX}POD_NAME", "").strip(),
        revision=env.get(f"{PREFIX}REVISION", "").strip(),
    )
