"""The scheduler's waiting queue: the requests `Scheduler.schedule` may admit, in the order it admits them, and
which running request gives its pages back when they run out; one class per `--scheduling-policy` (vLLM's flag).

fcfs (the default): arrival order; a retracted request goes back to the front, and the newest admitted one is
retracted first. priority: the highest `priority` first (`SamplingParams.priority`; higher first here, while vLLM
serves lower values first), by arrival among equals (`Req.arrival`, then the order they were added); a retracted
request goes back to its place by both, and the one retracted first for a running request's pages is the
lowest-priority, latest-arrived one whose priority is not above that request's. A waiting request that lacks
a running slot or pages preempts running ones of lower priority (`preemptee`: they are retracted, the lowest
first, until it fits); under fcfs none is ever preempted.
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disagg_worker.engine.request import Req


class WaitingQueue(ABC):
    """Requests waiting for admission; iterating gives them in the order the scheduler tries to admit them."""

    @abstractmethod
    def add(self, req: Req) -> None:
        """A request that just arrived."""

    @abstractmethod
    def requeue(self, req: Req) -> None:
        """A running request sent back (retracted): it keeps its tokens and waits to be admitted again."""

    @abstractmethod
    def remove(self, req: Req) -> None:
        """Take `req` out (admitted, or ended while it waited); ValueError if it is not here."""

    @abstractmethod
    def __iter__(self) -> Iterator[Req]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def rank(self, req: Req) -> tuple:
        """Sorts requests in this policy's order of admission (the decode prealloc queue's order too)."""

    def victim(self, candidates: Sequence[Req], beneficiary: Req) -> Req | None:
        """Which of `candidates` (retractable running requests, in the order admitted) to retract first when
        `beneficiary`, running, lacks pages for its next tokens: the newest admitted; None when there is none."""
        return candidates[-1] if candidates else None

    def preemptee(self, waiting: Req, running: Sequence[Req]) -> Req | None:
        """Which of `running` to retract first for `waiting`, the first waiting request, when it lacks a running
        slot or its pages; None: it waits for them (fcfs, always)."""
        return None


class FcfsQueue(WaitingQueue):
    """First come, first served: a request's priority is ignored."""

    def __init__(self) -> None:
        self._reqs: deque[Req] = deque()

    def add(self, req: Req) -> None:
        self._reqs.append(req)

    def requeue(self, req: Req) -> None:
        self._reqs.appendleft(req)

    def remove(self, req: Req) -> None:
        self._reqs.remove(req)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def rank(self, req: Req) -> tuple:
        return ()  # one rank for all: a stable sort keeps arrival order


class PriorityQueue(WaitingQueue):
    """The highest priority first, by arrival among equals; kept sorted, so admission reads it in order."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, float, int, Req]] = []  # (-priority, arrival, added, req): sorted
        self._added = itertools.count()

    def add(self, req: Req) -> None:
        bisect.insort(self._entries, (*self.rank(req), next(self._added), req))

    def requeue(self, req: Req) -> None:
        self.add(req)  # its rank is its priority and arrival: back where it was

    def remove(self, req: Req) -> None:
        i = next((i for i, e in enumerate(self._entries) if e[3] is req), None)
        if i is None:
            raise ValueError(f"request {req.rid} is not waiting")
        del self._entries[i]

    def __iter__(self) -> Iterator[Req]:
        return iter([e[3] for e in self._entries])

    def __len__(self) -> int:
        return len(self._entries)

    def rank(self, req: Req) -> tuple[int, float]:
        return -req.params.priority, req.arrival

    def victim(self, candidates: Sequence[Req], beneficiary: Req) -> Req | None:
        """The lowest-priority, latest-arrived of those whose priority is not above `beneficiary`'s (one above it
        would come back and preempt it in turn)."""
        return self._last([r for r in candidates if r.params.priority <= beneficiary.params.priority])

    def preemptee(self, waiting: Req, running: Sequence[Req]) -> Req | None:
        """The lowest-priority, latest-arrived of those of lower priority than `waiting` (strictly: two of one
        priority never preempt each other)."""
        return self._last([r for r in running if r.params.priority < waiting.params.priority])

    def _last(self, reqs: list[Req]) -> Req | None:
        return max(reversed(reqs), key=self.rank) if reqs else None


POLICIES: dict[str, type[WaitingQueue]] = {"fcfs": FcfsQueue, "priority": PriorityQueue}


def waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue of `--scheduling-policy` `policy`."""
    return POLICIES[policy]()
