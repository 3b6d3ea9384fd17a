"""What the scheduler asks of the tiers under its prefix cache, and the tiers of an instance without them.

`engine/tiers.py` (`KVTiers`: host memory and the Mooncake Store under the radix cache) is the one real
member; an instance run without `--enable-hierarchical-cache` gets `NoTiers`, which holds nothing and never
makes a request wait, so that the scheduler's paths read the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from disagg_worker.mem.kv_events import Event


class Tiers(Protocol):
    wake: Callable[[], None]  # called from the tiers' threads when a read a request waits on lands

    def prefetch(self, rid: str, tokens: Sequence[int]) -> None:
        """A request arrived: start reading the pages of its prompt that the tiers hold."""

    def ready(self, rid: str) -> bool:
        """Whether `rid` may be admitted now (its reads are done, or not worth waiting for)."""

    def admit(self, rid: str, tokens: Sequence[int], take_pages: Callable[[int], list[int] | None]) -> bool:
        """Load what the tiers hold of `tokens` into pages from `take_pages`; False: not now (no pages)."""

    def forget(self, rid: str) -> None:
        """The request left (admitted or aborted): drop what was read for it."""

    def take_events(self) -> list[Event]:
        """What the tiers stored or dropped since the last call (KV events)."""

    def close(self) -> None: ...


class NoTiers:
    """No tier under the prefix cache: every request is ready, nothing is loaded or recorded."""

    def __init__(self) -> None:
        self.wake: Callable[[], None] = lambda: None

    def prefetch(self, rid: str, tokens: Sequence[int]) -> None:
        return None

    def ready(self, rid: str) -> bool:
        return True

    def admit(self, rid: str, tokens: Sequence[int], take_pages: Callable[[int], list[int] | None]) -> bool:
        return True

    def forget(self, rid: str) -> None:
        return None

    def take_events(self) -> list[Event]:
        return []

    def close(self) -> None:
        return None
