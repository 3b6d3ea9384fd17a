"""One worker as the router sees it: its role and address, its health and latest /health report, the load it
reported and the load this router put on it (per attention group with DP attention), how a request's
attention group is picked there, the LoRA adapters it serves, and whether it is held out of rotation (a decode found
stalled, `stall.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from urllib.parse import urlsplit


class GroupPolicy(str, Enum):
    """How a request's attention group is picked on a worker with DP attention (its /health lists `dp_loads`).

    LOAD (the default): the group with the fewest of this router's requests open on it, then the lowest load
    the worker reported (other routers' requests too); under CACHE_AWARE a prefill's group by its cache first
    (`policies/groups.py`). ROOM: `bootstrap_room % dp_size`, blind to load: a
    group that drew long prompts keeps drawing its share, so it is there for comparison and for workers that
    report no loads."""

    LOAD = "load"
    ROOM = "room"


@dataclass(eq=False)
class Worker:
    url: str
    role: str  # "prefill" | "decode"
    bootstrap_port: int = 0
    healthy: bool = False
    inflight: int = 0
    failures: int = 0
    # The latest /health body: pod name, pairing revision, handoff queues and counters (server/health.py).
    report: dict = field(default_factory=dict)
    # The context the worker serves (its /v1/models `max_model_len`); 0 until it answered.
    max_model_len: int = 0
    # Health probes in a row that timed out (see RouterTuning.health_timeouts_to_unhealthy).
    health_timeouts: int = 0
    # DP attention: this router's requests open on each attention group.
    group_inflight: dict[int, int] = field(default_factory=dict)
    # Prompt tokens this router's running prefills compute here (what their cache did not hold), and per group.
    pending_tokens: int = 0
    group_pending: dict[int, int] = field(default_factory=dict)
    # When (monotonic) a migrating stream from it last delivered an event, on any of its streams (`migrate.py`).
    last_event: float = 0.0
    # Out of rotation until then (monotonic), whatever its /health says: a decode whose streams all stalled
    # (`stall.py`). The pool's picks and pair verification take it for unavailable meanwhile.
    held_until: float = 0.0

    def hold_out(self, until: float) -> None:
        """Keep the worker out of rotation until `until` (monotonic); a later hold only extends it."""
        self.held_until = max(self.held_until, until)

    def held_out(self, now: float) -> bool:
        return now < self.held_until

    def available(self, now: float) -> bool:
        """It may take a request now: healthy and not held out."""
        return self.healthy and not self.held_out(now)

    def reported(self, key: str) -> int:
        """A figure of the worker's load as its last /health said (`requests` it holds, from every router, in any
        queue; `kv_used` and `kv_total` pages); 0 when absent."""
        load = self.report.get("load")
        n = load.get(key, 0) if isinstance(load, dict) else 0
        return n if isinstance(n, int) and not isinstance(n, bool) else 0

    @property
    def busy(self) -> int:
        """Requests the worker holds: this router's open ones or, when more, those it reported (other routers')."""
        return max(self.inflight, self.reported("requests"))

    @property
    def kv_use(self) -> float:
        """The share of its KV pages in use, as it reported (0 before a report)."""
        total = self.reported("kv_total")
        return self.reported("kv_used") / total if total else 0.0

    @property
    def dp_loads(self) -> list[int]:
        """The load of each attention group as the worker last reported it ([] without DP attention)."""
        loads = self.report.get("dp_loads")
        if not isinstance(loads, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in loads):
            return []
        return loads if len(loads) > 1 else []

    def pick_group(self, policy: GroupPolicy, room: int) -> int | None:
        """The attention group for a request (None: the worker runs one)."""
        loads = self.dp_loads
        if not loads:
            return None
        if policy is GroupPolicy.ROOM:
            return room % len(loads)
        return min(range(len(loads)), key=lambda g: (self.group_inflight.get(g, 0), loads[g], g))

    def take(self, group: int | None) -> None:
        """A request of this router opens on this worker (on `group`)."""
        self.inflight += 1
        if group is not None:
            self.group_inflight[group] = self.group_inflight.get(group, 0) + 1

    def add_tokens(self, n: int, group: int | None) -> None:
        """A prefill of `n` uncached prompt tokens starts here (on `group`)."""
        self.pending_tokens += n
        if group is not None:
            self.group_pending[group] = self.group_pending.get(group, 0) + n

    def release_tokens(self, n: int, group: int | None = None) -> None:
        """It ended."""
        self.pending_tokens -= n
        if group is not None:
            self.group_pending[group] -= n

    def give_back(self, group: int | None) -> None:
        """It ended."""
        self.inflight -= 1
        if group is not None:
            self.group_inflight[group] -= 1

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def name(self) -> str:
        """The pod name the worker reports, or its URL."""
        return str(self.report.get("pod") or self.url)

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters the worker serves, as its last /health listed them (`lora_adapters`)."""
        names = self.report.get("lora_adapters")
        return [a for a in names if isinstance(a, str)] if isinstance(names, list) else []

    @property
    def resident(self) -> list[str]:
        """The LoRA adapters the worker's slots hold, as its last /health listed them (`lora_resident`)."""
        names = self.report.get("lora_resident")
        return [a for a in names if isinstance(a, str)] if isinstance(names, list) else []

    @property
    def revision(self) -> str:
        """Pairing revision: only a prefill and a decode of the same revision are paired."""
        return str(self.report.get("revision") or "")

    def take_report(self, body: bytes) -> None:
        try:
            report = json.loads(body)
        except ValueError:
            return
        if isinstance(report, dict):
            self.report = report

    def describe(self, now: float) -> dict:
        d: dict = {"url": self.url, "role": self.role, "healthy": self.healthy, "inflight": self.inflight}
        if self.held_out(now):
            d["held_out_s"] = round(self.held_until - now, 1)
        if self.role == "prefill":
            d["bootstrap_port"] = self.bootstrap_port
        if self.report.get("pod") or self.revision:
            d.update(pod=self.name, revision=self.revision)
        if self.adapters:  # the operator's Ready waits for a healthy pair serving each declared adapter
            d["lora_adapters"] = self.adapters
            d["lora_resident"] = self.resident  # which the router prefers for a request of one (`WorkerPool.cold`)
        return d
