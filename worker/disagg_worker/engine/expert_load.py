"""Expert load of an MoE model as Prometheus series: tokens routed to each expert, and which EP rank
holds it (`disagg_moe_routed_tokens_total{expert, ep_rank}`).

Imbalance is what expert-parallel deployments fight: one hot expert makes its rank the step's
straggler. The counts are the routers' own choices (every rank routes every token), summed over the
MoE layers of this rank's pipeline stage, published with the scheduler's reports.
"""

from __future__ import annotations

import torch
from prometheus_client import Counter

_ROUTED = Counter(
    "disagg_moe_routed_tokens",
    "Tokens routed to each expert, summed over the MoE layers of the reporting pipeline stage",
    ["expert", "ep_rank"],
)


class ExpertLoad:
    def __init__(self, model: torch.nn.Module | None, ep_size: int):
        self.model, self.ep_size = model, ep_size
        self.published: list[int] = []

    def publish(self) -> None:
        """Add what was routed since the last call to the counters."""
        routed = getattr(self.model, "routed_tokens", None)
        counts = routed() if callable(routed) else None
        if counts is None:
            return
        now = counts.tolist()
        per_rank = len(now) // self.ep_size
        before = self.published or [0] * len(now)
        for e, (n, was) in enumerate(zip(now, before, strict=True)):
            if n > was:
                _ROUTED.labels(str(e), str(e // per_rank)).inc(n - was)
        self.published = now
