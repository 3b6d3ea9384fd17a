"""The environment the Mooncake transfer engine must start with, as a pure function of config.

Mooncake reads its settings from environment variables when its transports start, not from
arguments. `mooncake_environ(cfg, rank)` says which variables and values; the scheduler process
entry point (`instance.process.run_scheduler`) applies them once before the engine is built, and
library code never writes `os.environ`.
"""

from __future__ import annotations

from importlib import metadata

from disagg_worker.config import DisaggConfig, Role

# The Mooncake builds on PyPI, by distribution name, and whether their engine reads device (CUDA) memory.
BUILDS = {
    "mooncake-transfer-engine-non-cuda": False,
    "mooncake-transfer-engine": True,  # CUDA 12
    "mooncake-transfer-engine-cuda13": True,  # CUDA 13, as PyPI's torch
}
TCP_LANES = "MC_TCP_LANES_PER_PEER"
MIN_PORT = "MC_MIN_RPC_PORT"
MAX_PORT = "MC_MAX_RPC_PORT"


def mooncake_environ(cfg: DisaggConfig, rank: int = 0) -> dict[str, str]:
    """Variables to set for the process of rank `rank` (`cfg.rank_index`) that runs `cfg` ({} when
    it builds no Mooncake engine).

    Ports: the engine listens on two ports (its RPC port, and the TCP transport's data port) that
    it picks in [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]; with `--transfer-port-base` that range is the
    rank's own window (`cfg.transfer_ports_of(rank)`), so the operator's NetworkPolicy can open
    exactly it. Without, the user's variables (or Mooncake's 15000-17000) apply.

    TCP connections per peer: `--tcp-lanes` (`cfg.tcp_lanes`), unless the user set
    MC_TCP_LANES_PER_PEER, whose value wins and is passed on verbatim (Mooncake parses and
    bounds it). Other transports do not use lanes.
    """
    if cfg.role is Role.MONOLITHIC or cfg.transfer_backend != "mooncake":
        return {}
    out: dict[str, str] = {}
    window = cfg.transfer_ports_of(rank)
    if window is not None:
        out[MIN_PORT], out[MAX_PORT] = str(window[0]), str(window[1])
    if cfg.transfer_protocol == "tcp":
        if cfg.mc_tcp_lanes_per_peer is not None:
            out[TCP_LANES] = cfg.mc_tcp_lanes_per_peer
        elif cfg.tcp_lanes > 0:
            out[TCP_LANES] = str(cfg.tcp_lanes)
    return out


def installed_build() -> str | None:
    """The distribution name of the installed Mooncake build (None: none is installed)."""
    for name in BUILDS:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return name
    return None


def device_problem(cfg: DisaggConfig, device: str) -> str:
    """Why this instance's KV on `device` cannot be sent or received by the installed Mooncake ("" if it can)."""
    if device == "cpu" or cfg.role is Role.MONOLITHIC or cfg.transfer_backend != "mooncake":
        return ""
    build = installed_build()
    if build is not None and BUILDS[build]:
        return ""
    return (
        f"--device {device}: the installed Mooncake build ({build or 'none'}) cannot read device memory, so it could "
        "not move this instance's KV; install the mooncake-cuda13 extra (mooncake-transfer-engine-cuda13)"
    )
