"""What the planner decides from: the user's targets and limits, the current replicas, and what was measured.

Every type here is a frozen dataclass so a decision is a pure function of its arguments and a test can build any
situation by hand; nothing reads the cluster.
"""

from dataclasses import dataclass, replace
from enum import Enum

from .. import names


class Mode(Enum):
    """Off: no decision at all. Advisory: decide and report, write nothing (what a user runs first, or beside an
    HPA that owns a role). Apply: decide and write the replicas."""

    OFF = "Off"
    ADVISORY = "Advisory"
    APPLY = "Apply"


@dataclass(frozen=True)
class Slo:
    """Latency targets, both held at `percentile` of requests (TTFT per request, ITL per generated token)."""

    ttft_ms: float
    itl_ms: float
    percentile: float = 90.0


@dataclass(frozen=True)
class RoleLimits:
    """One role's bounds; `gpus` is what one replica of it costs against the budget (0: it runs on CPUs)."""

    min: int = 1
    max: int = 8
    gpus: int = 0


@dataclass(frozen=True)
class PlannerSpec:
    """`prefill_per_decode`: None sizes the roles independently; a ratio keeps prefill at that many pods per decode
    pod (the operator derives prefill from decode), so the planner sizes decode for both roles' needs.
    `max_step`: the most replicas one decision adds or removes per role. `scale_down_stabilization_s`: a scale-down
    waits for the highest recommendation of this window, as Kubernetes' HPA does."""

    slo: Slo
    mode: Mode = Mode.ADVISORY
    prefill: RoleLimits = RoleLimits()
    decode: RoleLimits = RoleLimits()
    gpu_budget: int | None = None
    prefill_per_decode: float | None = None
    max_step: int = 4
    scale_down_stabilization_s: float = 300.0

    def limits(self, role: str) -> RoleLimits:
        return self.prefill if role == names.PREFILL else self.decode


@dataclass(frozen=True)
class Replicas:
    prefill: int
    decode: int

    def of(self, role: str) -> int:
        return self.prefill if role == names.PREFILL else self.decode

    def with_role(self, role: str, n: int) -> "Replicas":
        return replace(self, **{role: n})

    def gpus(self, spec: PlannerSpec) -> int:
        return self.prefill * spec.prefill.gpus + self.decode * spec.decode.gpus

    def __str__(self) -> str:
        return f"prefill {self.prefill}, decode {self.decode}"


@dataclass(frozen=True)
class Observations:
    """One interval's measurements (means per request), the load already predicted for the next interval.

    `queued_prefill_tokens` is reported but never counted as demand: a fixed number of closed-loop clients keeps it
    near concurrency x prompt length whatever the capacity, so sizing by it would chase the clients, not the load
    (llm-d's warning); arrivals are what grows when demand does. The measured latencies are at the SLO's
    percentile; None where nothing was measured this interval (no requests finished)."""

    arrival_rate: float  # requests per second
    uncached_prompt_tokens: float  # prompt tokens a prefill computes (not served by a prefix cache)
    prompt_tokens: float  # the whole prompt, which decode attends to and holds in its KV pool
    output_tokens: float
    queued_prefill_tokens: float = 0.0
    ttft_ms: float | None = None
    itl_ms: float | None = None
