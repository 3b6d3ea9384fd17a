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


def load_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    env = os.environ if environ is None else environ
    return WorkerEnv(auth_token=env.get(f"{PREFIX}AUTH_TOKEN", "").strip())
