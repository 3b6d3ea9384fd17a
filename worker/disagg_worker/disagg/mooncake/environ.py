"""The environment the Mooncake transfer engine must start with, as a pure function of config.

Mooncake reads its settings from environment variables when its transports start, not from
arguments. `mooncake_environ(cfg)` says which variables and values; the scheduler process
entry point (`engine.process.run_scheduler`) applies them once before the engine is built, and
library code never writes `os.environ`.
"""

from __future__ import annotations

from disagg_worker.config import DisaggConfig, Role

TCP_LANES = "MC_TCP_LANES_PER_PEER"


def mooncake_environ(cfg: DisaggConfig) -> dict[str, str]:
    """Variables to set for a process that runs `cfg` ({} when it builds no Mooncake engine).

    TCP connections per peer: `--tcp-lanes` (`cfg.tcp_lanes`), unless the user set
    MC_TCP_LANES_PER_PEER, whose value wins and is passed on verbatim (Mooncake parses and
    bounds it). Other transports do not use lanes.
    """
    uses_mooncake = cfg.role is not Role.MONOLITHIC and cfg.transfer_backend == "mooncake"
    if not uses_mooncake or cfg.transfer_protocol != "tcp":
        return {}
    if cfg.mc_tcp_lanes_per_peer is not None:
        return {TCP_LANES: cfg.mc_tcp_lanes_per_peer}
    return {TCP_LANES: str(cfg.tcp_lanes)} if cfg.tcp_lanes > 0 else {}
