"""Admission of generation requests at an HTTP front end: a worker's or the router's.

One gate in front of the generation handlers, passed before the body is read, in this order:
- the instance cannot serve (its scheduler process died): 503 with the reason;
- it drains (SIGTERM): 503 with Retry-After, so the client or the router goes elsewhere;
- it already holds `max_inflight` requests: 429 with Retry-After;
- the announced body is beyond the body limit: 413.
An admitted request is counted until its handler returns (a stream: after its last event), so
`wait_idle` tells a drain when everything admitted has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from aiohttp import web

from disagg_worker.server.body import check_length
from disagg_worker.server.errors import APIError, too_many_requests, unavailable

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})
RETRY_AFTER_S = 1
DRAINING = "draining"


class Admission:
    def __init__(self, max_inflight: int, body_limit: Callable[[], int]):
        self.max_inflight = max_inflight
        # A function: the router learns its limit from the workers after it starts.
        self.body_limit = body_limit
        self.inflight = 0
        self.draining = False
        # Why this instance cannot serve at all ("" while it can).
        self.broken = ""
        self._idle = asyncio.Event()
        self._idle.set()

    def refusal(self) -> APIError | None:
        """Why a new request is refused now (None: admit it)."""
        if self.broken:
            return unavailable(self.broken)
        if self.draining:
            message = "This server is shutting down and takes no new requests; retry on another instance."
            return unavailable(message, RETRY_AFTER_S, DRAINING)
        if self.inflight >= self.max_inflight:
            return too_many_requests(self.max_inflight, RETRY_AFTER_S)
        return None

    @contextmanager
    def admitted(self) -> Iterator[None]:
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    def start_drain(self) -> int:
        """Refuse new requests from now on; returns how many are held."""
        self.draining = True
        return self.inflight

    async def wait_idle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> bool:
        """Wait until nothing admitted is in flight (True), `timeout_s` passes or `hurry` is set (False)."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self.inflight == 0


def admission_middleware(admission: Admission, paths: frozenset[str] = GENERATION_PATHS):
    @web.middleware
    async def admit(request: web.Request, handler):
        if request.path not in paths:
            return await handler(request)
        refusal = admission.refusal()
        if refusal is not None:
            raise refusal
        check_length(request, admission.body_limit())
        with admission.admitted():
            return await handler(request)

    return admit
