"""round_robin: each role's candidates in turn, blind to load and to caches."""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.worker import Worker


@dataclass
class RoundRobin:
    # One turn counter per role: with a shared one, equal numbers of prefill and decode workers made every pick
    # land on the same pair.
    turns: dict[str, itertools.count] = field(default_factory=lambda: collections.defaultdict(itertools.count))

    def indexed(self, w: Worker) -> bool:
        return False

    def pick(self, role: str, candidates: list[Worker], prompt: Prompt | None) -> Worker:
        return candidates[next(self.turns[role]) % len(candidates)]

    def decode_only(self, d: Worker, prompt: Prompt | None) -> bool:
        return False
