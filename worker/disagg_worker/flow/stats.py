"""What flow control counts, for /metrics: requests dispatched from the queue, shed (evicted for a higher band, or
refused by a full queue) and expired, per band and flow.

A flow's label is bounded: the first `max_flows` flows seen keep their own name, every later one is counted under
"other", so that clients sending many fairness ids cannot grow the metrics without bound. (Flows named by API
keys are digests of the keys, never the keys.)
"""

from __future__ import annotations

from collections import Counter
from enum import Enum

OTHER = "other"
MAX_FLOW_LABELS = 32


class Outcome(str, Enum):
    DISPATCHED = "dispatched"  # it waited, then took a freed slot
    EVICTED = "evicted"  # shed from a full queue for a request of a higher band
    REFUSED = "refused"  # the queue was full and nothing below it to shed
    EXPIRED = "expired"  # its time to live passed in the queue
    LEFT = "left"  # its client went away while it waited


class FlowStats:
    def __init__(self, max_flows: int = MAX_FLOW_LABELS):
        self.max_flows = max_flows
        self._labelled: set[str] = set()
        self.counts: Counter[tuple[Outcome, int, str]] = Counter()

    def label(self, flow: str) -> str:
        """The flow's label: its own among the first `max_flows`, else "other"."""
        if flow in self._labelled:
            return flow
        if len(self._labelled) < self.max_flows:
            self._labelled.add(flow)
            return flow
        return OTHER

    def count(self, outcome: Outcome, priority: int, flow: str) -> None:
        self.counts[(outcome, priority, self.label(flow))] += 1
