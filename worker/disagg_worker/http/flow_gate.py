"""Waiting for an in-flight slot under flow control (`disagg_worker.flow`): the admission's asyncio side.

With flow control on, a request that finds every slot taken (`Admission.max_inflight`) waits in the flow queue,
on a future of its own, instead of an immediate 429. A request that finishes hands its slot straight to the
queue's next entry (`hand_on`: the slot is never free in between, so a newcomer cannot take it ahead of those
waiting). A waiter is answered 429 with Retry-After, in OpenAI's shape, when
- its time to live passes in the queue ("waited ... in the queue"),
- it is evicted for a request of a higher band, or of its band's flow with fewer waiting ("shed ..."),
- the queue is full and holds nothing below it ("the queue ... is full").
A client that leaves while its request waits takes it out of the queue; a drain refuses everything queued (503).
With flow control off (`NO_FLOW_CONTROL`, the default) nothing waits: the admission answers 429 at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from disagg_worker.flow.identity import Identity, body_priority, identify
from disagg_worker.flow.policy import FlowPolicy
from disagg_worker.flow.queue import Entry, FlowQueue
from disagg_worker.flow.stats import FlowStats, Outcome
from disagg_worker.http.auth import caller_of
from disagg_worker.request.errors import APIError

RETRY_AFTER_S = 1
Waiter = asyncio.Future[None]
# The priority flow control gave a request (its objective's, or the body's capped at its key's), set on the request
# by the admission: the router writes it into the body it forwards, so that the workers' `--scheduling-policy
# priority` orders by what the router allowed, never by what the client asked beyond its key.
PRIORITY = web.RequestKey("flow_priority", int)


def priority_of(request: web.Request) -> int | None:
    """The priority flow control gave `request`; None where flow control is off."""
    return request.get(PRIORITY)


class FlowControl(Protocol):
    on: bool
    stats: FlowStats  # what /metrics counts

    @property
    def queued(self) -> int: ...

    def queued_by_flow(self) -> dict[tuple[int, str], int]:
        """Requests waiting now, by (priority, flow label)."""
        ...

    def identify(self, request: web.Request, body: bytes) -> Identity:
        """Who the request is (a 400 for a bad priority or objective)."""
        ...

    async def wait(self, who: Identity, give_back: Callable[[], None]) -> None:
        """Wait until a freed slot is handed to this request (it then holds it) or raise the 429 that ends the
        wait; `give_back` frees a slot handed over just as the client left."""
        ...

    def hand_on(self) -> bool:
        """Give a freed slot to the next waiter; False when none waits (the slot is then free)."""
        ...

    def refuse_all(self, error: Callable[[], APIError]) -> None:
        """Answer everything queued with an `error()` each (a drain)."""
        ...


class NoFlowControl:
    """Flow control off: nothing waits, every request is the same (the admission refuses at once when full)."""

    on = False
    queued = 0

    def __init__(self) -> None:
        self.stats = FlowStats()

    def queued_by_flow(self) -> dict[tuple[int, str], int]:
        return {}

    def identify(self, request: web.Request, body: bytes) -> Identity:
        return Identity()

    async def wait(self, who: Identity, give_back: Callable[[], None]) -> None:
        raise RuntimeError("nothing waits without flow control: the admission refuses a request when full")

    def hand_on(self) -> bool:
        return False

    def refuse_all(self, error: Callable[[], APIError]) -> None:
        pass


NO_FLOW_CONTROL = NoFlowControl()


class FlowGate:
    """Flow control on: the queue of `policy`, its outcomes counted in `stats` (for /metrics)."""

    on = True

    def __init__(self, policy: FlowPolicy, stats: FlowStats | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.stats = stats if stats is not None else FlowStats()
        self.clock = clock
        self.queue: FlowQueue[Waiter] = FlowQueue(policy.queue_size, policy.ttl_s)

    @property
    def queued(self) -> int:
        return len(self.queue)

    def queued_by_flow(self) -> dict[tuple[int, str], int]:
        counts: Counter[tuple[int, str]] = Counter()
        for (priority, flow), n in self.queue.by_flow().items():
            counts[(priority, self.stats.label(flow))] += n
        return dict(counts)

    def identify(self, request: web.Request, body: bytes) -> Identity:
        return identify(self.policy, request.headers, body_priority(body), caller_of(request))

    async def wait(self, who: Identity, give_back: Callable[[], None]) -> None:
        waiter: Waiter = asyncio.get_running_loop().create_future()
        pushed = self.queue.push(waiter, who.priority, who.flow, self.clock())
        if pushed.evicted is not None:
            self._fail(pushed.evicted, Outcome.EVICTED, _shed(pushed.evicted.priority < who.priority))
        if pushed.entry is None:
            self.stats.count(Outcome.REFUSED, who.priority, who.flow)
            raise _queue_full(self.policy.queue_size)
        entry = pushed.entry
        try:
            await asyncio.wait([waiter], timeout=max(0.0, entry.deadline - self.clock()))
        except asyncio.CancelledError:  # the client left
            if waiter.done() and waiter.exception() is None:
                give_back()  # a slot was handed to it meanwhile: on to the next
            elif self.queue.remove(entry):
                self.stats.count(Outcome.LEFT, entry.priority, entry.flow)
            raise
        if not waiter.done():
            self._expire()
        if not waiter.done():  # woken a hair before its deadline (the loop's clock resolution)
            self.queue.remove(entry)
            self._fail(entry, Outcome.EXPIRED, _expired(self.policy.ttl_s))
        waiter.result()  # the 429 that ended its wait, if one did

    def hand_on(self) -> bool:
        self._expire()  # nothing past its deadline is served
        while (entry := self.queue.pop()) is not None:
            if not entry.item.done():
                entry.item.set_result(None)
                self.stats.count(Outcome.DISPATCHED, entry.priority, entry.flow)
                return True
        return False

    def refuse_all(self, error: Callable[[], APIError]) -> None:
        while (entry := self.queue.pop()) is not None:
            if not entry.item.done():
                entry.item.set_exception(error())

    def _expire(self) -> None:
        for entry in self.queue.expire(self.clock()):
            self._fail(entry, Outcome.EXPIRED, _expired(self.policy.ttl_s))

    def _fail(self, entry: Entry[Waiter], outcome: Outcome, error: APIError) -> None:
        self.stats.count(outcome, entry.priority, entry.flow)
        if not entry.item.done():
            entry.item.set_exception(error)


def _too_many(message: str) -> APIError:
    # OpenAI's shape for a rate limit: 429, type "requests", code "rate_limit_exceeded".
    return APIError(429, message, "requests", code="rate_limit_exceeded", retry_after=RETRY_AFTER_S)


def _expired(ttl_s: float) -> APIError:
    return _too_many(f"This request waited {ttl_s:g} s in the queue for a slot and was not served; retry later.")


def _shed(for_higher: bool) -> APIError:
    why = "of higher priority" if for_higher else "of a flow with fewer waiting (its own flow held the most)"
    return _too_many(f"This request was shed from the queue for a request {why}; retry later.")


def _queue_full(size: int) -> APIError:
    message = f"This server's queue of {size} requests is full, none of them of lower priority; retry later."
    return _too_many(message)
