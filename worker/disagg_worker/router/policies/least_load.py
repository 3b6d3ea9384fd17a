"""least_load: the worker holding the fewest requests (`Worker.busy`: this router's open ones, or more when the
worker reports more, other routers' included), then the lowest share of its KV pages in use, then the fewest
failures."""

from __future__ import annotations

from dataclasses import dataclass

from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.worker import Worker


def by_load(w: Worker) -> tuple[int, float, int]:
    """The order least load picks in (the least first)."""
    return w.busy, w.kv_use, w.failures


@dataclass
class LeastLoad:
    def indexed(self, w: Worker) -> bool:
        return False

    def pick(self, role: str, candidates: list[Worker], prompt: Prompt | None) -> Worker:
        return min(candidates, key=by_load)

    def decode_only(self, d: Worker, prompt: Prompt | None) -> bool:
        return False
