"""Operator configuration: every environment variable the operator reads, read once, with one prefix."""

import os
from dataclasses import dataclass

ENV_PREFIX = "DISAGG_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    """Settings that are not part of a DisaggregatedModel but shape what the builders produce."""

    cluster_domain: str = "cluster.local"
    gpu_resource: str = "nvidia.com/gpu"
    rdma_resource: str = "rdma/ib"
    # Seconds between ticks: router pods' /health read (when router_probe), rollout deadlines re-evaluated.
    tick_s: float = 10.0
    router_probe: bool = True
    router_probe_timeout_s: float = 2.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "OperatorConfig":
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            cluster_domain=env.get(f"{ENV_PREFIX}CLUSTER_DOMAIN", defaults.cluster_domain),
            gpu_resource=env.get(f"{ENV_PREFIX}GPU_RESOURCE", defaults.gpu_resource),
            rdma_resource=env.get(f"{ENV_PREFIX}RDMA_RESOURCE", defaults.rdma_resource),
            tick_s=float(env.get(f"{ENV_PREFIX}TICK_SECONDS", defaults.tick_s)),
            router_probe=env.get(f"{ENV_PREFIX}ROUTER_PROBE", "true").lower() not in ("0", "false", "no", "off"),
            router_probe_timeout_s=float(env.get(f"{ENV_PREFIX}ROUTER_PROBE_TIMEOUT", defaults.router_probe_timeout_s)),
        )
