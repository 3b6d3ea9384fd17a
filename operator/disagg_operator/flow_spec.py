"""`spec.router.flowControl`: the router's flow control (docs/flow-control.md), as the router builder needs it.

Present (and not `enabled: false`), the router gets `--flow-control` and every `--flow-*` setting, each at the CR's
value or the router's default; absent, none of them, so a model without the block runs the router it always ran.
An API key's cap names the key by its digest (the first 32 hex digits of its SHA-256, as the router names a
caller), never by the key itself: the CR holds nothing a client could use.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_api import router_settings as R
from disagg_api.setting import Setting


@dataclass(frozen=True)
class FlowControlSpec:
    """The flow-control settings of the router; `enabled` False: the null one, which sets no flag."""

    enabled: bool = False
    queue_size: int = R.FLOW_QUEUE_SIZE.default
    queue_ttl_s: float = R.FLOW_QUEUE_TTL.default
    min_priority: int = R.FLOW_MIN_PRIORITY.default
    max_priority: int = R.FLOW_MAX_PRIORITY.default
    # (objective name, priority), in the CR's order.
    objectives: tuple[tuple[str, int], ...] = ()
    # (an API key's digest, the highest priority its requests get), in the CR's order.
    key_priorities: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "FlowControlSpec":
        """The block's settings; the null one when the CR has no block or turns it off."""
        if d is None or not d.get("enabled", True):
            return cls()
        return cls(
            True,
            int(d.get("queueSize", R.FLOW_QUEUE_SIZE.default)),
            float(d.get("queueTTLSeconds", R.FLOW_QUEUE_TTL.default)),
            int(d.get("minPriority", R.FLOW_MIN_PRIORITY.default)),
            int(d.get("maxPriority", R.FLOW_MAX_PRIORITY.default)),
            tuple((str(o["name"]), int(o["priority"])) for o in d.get("objectives", ())),
            tuple((str(k["digest"]), int(k["priority"])) for k in d.get("keyPriorities", ())),
        )

    def settings(self) -> list[tuple[Setting, Any]]:
        """The router's `--flow-*` settings with their values; none when off."""
        if not self.enabled:
            return []
        values: list[tuple[Setting, Any]] = [
            (R.FLOW_CONTROL, True),
            (R.FLOW_QUEUE_SIZE, self.queue_size),
            (R.FLOW_QUEUE_TTL, self.queue_ttl_s),
            (R.FLOW_MIN_PRIORITY, self.min_priority),
            (R.FLOW_MAX_PRIORITY, self.max_priority),
        ]
        if self.objectives:
            values.append((R.FLOW_OBJECTIVES, _pairs(self.objectives)))
        if self.key_priorities:
            values.append((R.FLOW_KEY_PRIORITY, _pairs(self.key_priorities)))
        return values


def _pairs(pairs: tuple[tuple[str, int], ...]) -> str:
    """The flags' `NAME=PRIORITY,...` form."""
    return ",".join(f"{name}={priority}" for name, priority in pairs)
