"""The SLO planner's core: how many prefill and decode replicas keep TTFT and ITL within their targets.

Pure and cluster-free (nothing here reads or writes Kubernetes): `inputs` (targets, limits, measurements),
`capacity` (a step-time model and what one replica sustains within a target), `fit` (that model fitted online
from per-step records, seeded by a profile), `sizing` (the slow loop), `correction` (the fast +-1 loop),
`constraints` (stabilisation, step limit, floors and maxima, rollout hold, GPU budget) and `decide` (`plan`,
composing them). The shape follows NVIDIA Dynamo's planner: a predictive slow loop over a per-replica capacity
model and a fast loop on measured latency, bounded by budgets, with an advisory mode.
"""

from .decide import Decision, plan

__all__ = ["Decision", "plan"]
