"""The router's flow control (`--flow-control`, docs/flow-control.md): its gate built from the flags, and its
/metrics.

The gate is the admission's (`http/flow_gate.py`); its queue and rules are `disagg_worker.flow`'s. Off (the
default), requests beyond --max-inflight get 429 at once, as before.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from disagg_worker.flow.policy import FlowPolicy, parse_priorities
from disagg_worker.flow.stats import Outcome
from disagg_worker.http.flow_gate import NO_FLOW_CONTROL, FlowControl, FlowGate

# How `http.auth.caller_of` names a key: the first 32 hex digits of its SHA-256.
KEY_DIGEST = re.compile(r"[0-9a-f]{32}")


def flow_control(ns: argparse.Namespace) -> FlowControl:
    """The gate the flags ask for; SystemExit naming the flag that is malformed."""
    if not ns.flow_control:
        return NO_FLOW_CONTROL
    try:
        key_max = parse_priorities(ns.flow_key_priority, "--flow-key-priority")
        for digest in key_max:
            if not KEY_DIGEST.fullmatch(digest):
                raise ValueError(f"--flow-key-priority: {digest!r} is not a key's digest (32 lowercase hex digits)")
        policy = FlowPolicy(
            queue_size=ns.flow_queue_size,
            ttl_s=ns.flow_queue_ttl,
            objectives=parse_priorities(ns.flow_objectives, "--flow-objectives"),
            min_priority=ns.flow_min_priority,
            max_priority=ns.flow_max_priority,
            key_max=key_max,
        )
        return FlowGate(policy)
    except ValueError as e:
        raise SystemExit(f"disagg router: {e}") from None


class FlowCollector:
    """Requests waiting now and what became of those that waited, by priority and flow (the first flows seen
    keep their own label, the rest are "other": `flow/stats.py`)."""

    def __init__(self, flow: FlowControl):
        self.flow = flow

    def collect(self) -> Iterator[Metric]:
        labels = ["priority", "flow"]
        queued = GaugeMetricFamily(
            "disagg_router_flow_queued", "Requests waiting in the flow-control queue for a slot", labels=labels
        )
        for (priority, flow), n in sorted(self.flow.queued_by_flow().items()):
            queued.add_metric([str(priority), flow], n)
        outcomes = CounterMetricFamily(
            "disagg_router_flow_requests",
            "Requests that waited in the flow-control queue, by outcome (dispatched: took a freed slot; evicted: "
            "shed for a higher priority; refused: the queue was full; expired: --flow-queue-ttl passed; left: the "
            "client went away)",
            labels=["outcome", *labels],
        )
        for (outcome, priority, flow), n in sorted(self.flow.stats.counts.items()):
            outcomes.add_metric([Outcome(outcome).value, str(priority), flow], n)
        yield from (queued, outcomes)
