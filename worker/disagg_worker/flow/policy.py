"""What a deployment declares for flow control (`--flow-*`): its objectives, the priorities it allows, each API
key's highest priority, and its queue's bound and time to live.

A priority is an int, higher first; a negative one is sheddable (it is the first to be evicted from a full
queue, as any lowest band is). An objective names a priority (`x-gateway-inference-objective: batch` with
`--flow-objectives batch=-1`), as the Gateway API Inference Extension's InferenceObjective does.

A key's maximum is a cap, not a check: a request above its key's maximum is served at that maximum (clamped),
not refused. The client cannot know the cap (it is the deployment's, per key), a constant `priority` in a
client's code or an objective a gateway sets for a whole route would otherwise fail every request of that key,
and clamping takes from the request nothing the key was owed. A priority outside the allowed range is the
client's mistake and is refused (400), as is an unknown objective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_PRIORITY = 0


@dataclass(frozen=True)
class FlowPolicy:
    queue_size: int = 256
    ttl_s: float = 30.0
    objectives: Mapping[str, int] = field(default_factory=dict)
    min_priority: int = -10
    max_priority: int = 10
    # The caller (`http.auth.caller_of`: a digest of the key) -> the highest priority its requests get.
    key_max: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.min_priority > self.max_priority:
            raise ValueError(f"flow control: the lowest priority {self.min_priority} is above the highest")
        declared = [*self.objectives.values(), *self.key_max.values()]
        outside = [p for p in declared if not self.allows(p)]
        if outside:
            raise ValueError(f"flow control: priority {outside[0]} is outside {self.min_priority}..{self.max_priority}")

    def allows(self, priority: int) -> bool:
        return self.min_priority <= priority <= self.max_priority

    def capped(self, priority: int, caller: str) -> int:
        """`priority` within what `caller`'s key allows (see the module: clamped, not refused)."""
        return min(priority, self.key_max.get(caller, self.max_priority))


def parse_priorities(text: str, what: str) -> dict[str, int]:
    """`name=priority,...` (the flags' form) as a mapping; a ValueError naming `what` when malformed."""
    pairs: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.rpartition("=")
        try:
            pairs[name.strip()] = int(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"{what}: {item!r} is not NAME=PRIORITY (an integer)")
    return pairs
