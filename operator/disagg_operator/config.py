"""Operator configuration: every environment variable the operator reads, read once, with one prefix."""

import os
from dataclasses import dataclass
from typing import Any

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
    # Where the operator's own pods are (the chart sets both): a model's NetworkPolicies let them read the workers'
    # /metrics when the SLO planner runs. Empty (the operator run outside the cluster): no rule is added for it.
    namespace: str = ""
    pod_labels: tuple[tuple[str, str], ...] = ()

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
            namespace=env.get(f"{ENV_PREFIX}NAMESPACE", defaults.namespace),
            pod_labels=parse_labels(env.get(f"{ENV_PREFIX}POD_LABELS", "")),
        )

    @property
    def pod_peer(self) -> dict[str, Any] | None:
        """The operator's pods as a NetworkPolicy peer; None when it does not know where they are."""
        if not self.namespace or not self.pod_labels:
            return None
        return {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.namespace}},
            "podSelector": {"matchLabels": dict(self.pod_labels)},
        }


# What the builders assume when a caller gives no configuration (the defaults of every setting).
DEFAULT_CFG = OperatorConfig()


def parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    """`key=value,key=value` (the chart's selector labels) as pairs; a malformed entry is a ValueError naming it."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{ENV_PREFIX}POD_LABELS: {entry!r} is not key=value")
        out.append((key.strip(), value.strip()))
    return tuple(out)
