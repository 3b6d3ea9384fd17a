"""Every environment variable the worker reads, in one typed place.

Read once at start-up with `load_env()` (`config.server_args_from_cli` puts the values into the
config chain); pass the values down instead of reading `os.environ` elsewhere.

The worker's own variables have the prefix `DISAGG_`. Mooncake's transfer engine reads its own
`MC_*` variables itself; the worker reads only the one it also sets, so that the user's value
is known:
- `MC_TCP_LANES_PER_PEER`: TCP connections per peer. The worker sets it from `--tcp-lanes`
  unless the user set it (`disagg.mooncake.environ`).
Others reach Mooncake untouched: `MC_MIN_RPC_PORT` / `MC_MAX_RPC_PORT` (the transfer port range;
the operator sets them so that its NetworkPolicy can open exactly those ports), `MC_LOG_LEVEL`
(`serve --local` and the worker image default it to WARNING), and the engine's timeouts
(`MC_TRANSFER_TIMEOUT`, `MC_TCP_PROGRESS_TIMEOUT_SEC`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

PREFIX = "DISAGG_"


@dataclass(frozen=True)
class WorkerEnv:
    # Bearer token for the bootstrap server ("" disables auth). Both ends must agree.
    auth_token: str = field(default="", repr=False)
    # MC_TCP_LANES_PER_PEER as the user set it, verbatim (None: not set).
    mc_tcp_lanes_per_peer: str | None = None
    # Fault injection for tests (DISAGG_FAULT_FAIL_SENDERS_ON_STAGE): prefill ranks of this pipeline
    # stage fail every new KV sender at once, locally, telling nobody. -1: off.
    fault_fail_senders_on_stage: int = -1


def load_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    env = os.environ if environ is None else environ
    return WorkerEnv(
        auth_token=env.get(f"{PREFIX}AUTH_TOKEN", "").strip(),
        mc_tcp_lanes_per_peer=env.get("MC_TCP_LANES_PER_PEER"),
        fault_fail_senders_on_stage=int(env.get(f"{PREFIX}FAULT_FAIL_SENDERS_ON_STAGE", "-1")),
    )
