"""Every environment variable the worker reads, in one typed place.

Read once at start-up with `load_env()` (`cli_args.server_args_from_cli` puts the values into the
config chain); pass the values down instead of reading `os.environ` elsewhere.

Secrets never come from the environment (an environment is inherited by every child process and
shows in process listings): the model's shared secret and API keys are files (`--auth-token-file`,
`--api-key-file`). Mooncake's transfer engine reads its own `MC_*` variables itself; the worker
reads only those it also sets, so that the user's values are known:
- `MC_TCP_LANES_PER_PEER`: TCP connections per peer. The worker sets it from `--tcp-lanes`
  unless the user set it (`disagg.mooncake.environ`).
- `MC_MIN_RPC_PORT` / `MC_MAX_RPC_PORT`: the engine's port range. The worker sets them per rank
  from `--transfer-port-base` (what the operator's NetworkPolicy opens); setting both is an error.
The worker's own variables: `DISAGG_POD_NAME` and `DISAGG_REVISION` (set by the operator from the
pod's name and its `disagg.dev/revision` label; reported on /health), and a test hook,
`DISAGG_FAULT_FAIL_SENDERS_ON_STAGE=N`, which makes the prefill ranks of pipeline stage N fail every
new KV sender locally (the fault tests of parallel ranks), `DISAGG_FAULT_GRAMMAR_PATTERN=P`, which
makes compiling the regex P raise an exception of a type no compiler raises (the isolation tests), and
`DISAGG_FAULT_STALL_AFTER_LAYER_GROUP=N:PATH`, which makes a prefill rank's layer-wise streamed forward stop
after queuing layer group N while the file PATH does not exist (the P/D fault tests of layer-wise streaming),
and `DISAGG_FAULT_STALL_DECODE=PATH`, which makes a decode instance's scheduler loop take no step while the file
PATH exists, its HTTP side and its reports (so its /health) going on (the router's stalled-decode tests).
Others reach Mooncake untouched: `MC_LOG_LEVEL` (`serve --local` and the worker image default it to
WARNING) and the engine's timeouts (`MC_TRANSFER_TIMEOUT`, `MC_TCP_PROGRESS_TIMEOUT_SEC`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerEnv:
    # The pod's name (Kubernetes downward API); reported on /health so routers and the operator can name it.
    pod_name: str = ""
    # Pairing revision of this instance (the pod's `disagg.dev/revision` label): the router pairs a prefill
    # only with a decode of the same revision, so a rollout never mixes incompatible halves. "" outside Kubernetes.
    revision: str = ""
    # MC_TCP_LANES_PER_PEER as the user set it, verbatim (None: not set).
    mc_tcp_lanes_per_peer: str | None = None
    # Fault injection for tests (DISAGG_FAULT_FAIL_SENDERS_ON_STAGE): prefill ranks of this pipeline
    # stage fail every new KV sender at once, locally, telling nobody. -1: off.
    fault_fail_senders_on_stage: int = -1
    # Fault injection for tests (DISAGG_FAULT_GRAMMAR_PATTERN): compiling this regex raises an unexpected
    # exception type. "": off.
    fault_grammar_pattern: str = ""
    # Fault injection for tests (DISAGG_FAULT_STALL_AFTER_LAYER_GROUP=N:PATH): a prefill rank's streamed forward
    # stalls after queuing layer group N while the file PATH does not exist. (-1, ""): off.
    fault_stall_after_layer_group: tuple[int, str] = (-1, "")
    # Fault injection for tests (DISAGG_FAULT_STALL_DECODE=PATH): a decode's scheduler loop takes no step while the
    # file PATH exists. "": off.
    fault_stall_decode: str = ""
    # MC_MIN_RPC_PORT and MC_MAX_RPC_PORT as the user set them (None: not set).
    mc_rpc_port_range: tuple[str | None, str | None] = (None, None)


def load_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    env = os.environ if environ is None else environ
    return WorkerEnv(
        pod_name=env.get("DISAGG_POD_NAME", "").strip(),
        revision=env.get("DISAGG_REVISION", "").strip(),
        mc_tcp_lanes_per_peer=env.get("MC_TCP_LANES_PER_PEER"),
        fault_fail_senders_on_stage=int(env.get("DISAGG_FAULT_FAIL_SENDERS_ON_STAGE", "-1")),
        fault_grammar_pattern=env.get("DISAGG_FAULT_GRAMMAR_PATTERN", ""),
        fault_stall_after_layer_group=group_and_path(env.get("DISAGG_FAULT_STALL_AFTER_LAYER_GROUP", "")),
        fault_stall_decode=env.get("DISAGG_FAULT_STALL_DECODE", ""),
        mc_rpc_port_range=(env.get("MC_MIN_RPC_PORT"), env.get("MC_MAX_RPC_PORT")),
    )


def group_and_path(value: str) -> tuple[int, str]:
    """`N:PATH` as (N, PATH); "" as (-1, "") (off)."""
    if not value:
        return (-1, "")
    group, sep, path = value.partition(":")
    if not sep or not path:
        raise ValueError(f"DISAGG_FAULT_STALL_AFTER_LAYER_GROUP is N:PATH, not {value!r}")
    return (int(group), path)
