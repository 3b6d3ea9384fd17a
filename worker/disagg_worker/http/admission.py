"""Admission of generation requests at an HTTP front end: a worker's or the router's.

One gate in front of the generation handlers, in this order:
- the instance cannot serve (its scheduler process died): 503 with the reason;
- it drains (SIGTERM): 503 with Retry-After, so the client or the router goes elsewhere;
- it already holds `max_inflight` requests: 429 with Retry-After; with flow control on (`flow_gate.py`), the
  request waits in the flow queue instead, once its body has arrived (its priority may be in it), and takes the
  slot the next finished request hands on;
- the announced body is beyond the body limit: 413;
- then the body is read (`body.read_body`: 413 past the limit, 408 past its time limit) before the request
  takes a slot, so that slow uploads cannot hold every slot; the bytes of the bodies being read or held by
  admitted requests are bounded together (`body_budget`: 429 past it), so that many large bodies at once
  cannot exhaust the process's memory, and where clients connect with API keys, each key's (`client_budget`),
  so that one client's stalled uploads leave the others room; the checks above are made again once it has
  arrived.
A decode instance's hand-off (a gateway named the prefill, `router/decode_handoff.py`) sends its decode leg back
to its own port: that leg carries `LEG_HEADER` with this process's `leg_token` and is let through uncounted, its
body read within the limit, since the client's request it serves was admitted and counted already (counting it
twice would halve the bound, and refuse a leg of an admitted request once a drain began).
An admitted request is counted until its handler returns (a stream: after its last event), so
`wait_idle` tells a drain when everything admitted has finished. Handlers find the body with `body_of`.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from aiohttp import web

from disagg_worker.http.auth import caller_of
from disagg_worker.http.body import BODY_READ_TIMEOUT_S, check_length, read_body
from disagg_worker.http.flow_gate import NO_FLOW_CONTROL, PRIORITY, FlowControl
from disagg_worker.request.errors import APIError, too_many_requests, unavailable

# Requests whose bodies are read within a time limit and a byte budget before they take an in-flight slot.
GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate", "/tokenize", "/detokenize"}
)
RETRY_AFTER_S = 1
DRAINING = "draining"
DRAIN_MESSAGE = "This server is shutting down and takes no new requests; retry on another instance."
# Bytes of request bodies one front end holds at once (being read, or held by admitted requests). Parsed, a body
# takes up to ~5x its bytes (a list of token ids), so 128 MiB keeps them well inside a 1 GiB router or worker.
BODY_BUDGET_BYTES = 128 << 20
# What one client (an API key) may hold of that budget at a front end clients reach (the router, a
# monolithic server), so that one client's unfinished uploads leave the others room; at least one whole body.
CLIENT_BODY_BUDGET_BYTES = BODY_BUDGET_BYTES // 4
# The header naming a hand-off's own decode leg (its value: `Admission.leg_token`, which never leaves the process's
# loopback connections to itself).
LEG_HEADER = "X-Disagg-Handoff-Leg"
_BODY: Any = web.RequestKey("body", bytes) if hasattr(web, "RequestKey") else "disagg.body"  # aiohttp < 3.12


def body_of(request: web.Request) -> bytes:
    """The body the admission read (given once: the handler then holds the only reference)."""
    return request.pop(_BODY)


class Admission:
    def __init__(
        self,
        max_inflight: int,
        body_limit: Callable[[], int],
        body_budget: int = BODY_BUDGET_BYTES,
        body_timeout_s: float = BODY_READ_TIMEOUT_S,
        client_budget: int | None = None,
        flow: FlowControl = NO_FLOW_CONTROL,
    ):
        """`client_budget`: the bytes of bodies one client may hold (None: the whole budget, as at a P/D worker,
        whose one client is the router); `flow`: where a request waits when every slot is taken (by default
        nowhere: it is refused)."""
        self.flow = flow
        self.max_inflight = max_inflight
        # A function: the router learns its limit from the workers after it starts.
        self.body_limit = body_limit
        self.body_budget = body_budget
        self.client_budget = client_budget if client_budget is not None else body_budget
        self.client_bytes: dict[str, int] = {}  # held by each client that holds some
        self.body_timeout_s = body_timeout_s
        self.body_bytes = 0
        self.inflight = 0
        self.draining = False
        # Why this instance cannot serve at all ("" while it can).
        self.broken = ""
        self._idle = asyncio.Event()
        self._idle.set()
        self.leg_token = secrets.token_urlsafe(24)

    def is_leg(self, request: web.Request) -> bool:
        """A hand-off's own decode leg, sent by this process to itself (`LEG_HEADER`)."""
        presented = request.headers.get(LEG_HEADER, "")
        return bool(presented) and hmac.compare_digest(presented.encode(), self.leg_token.encode())

    def refusal(self) -> APIError | None:
        """Why a new request is refused now (None: admit it, or with flow control on let it wait for a slot)."""
        if self.broken:
            return unavailable(self.broken)
        if self.draining:
            return unavailable(DRAIN_MESSAGE, RETRY_AFTER_S, DRAINING)
        if self.inflight >= self.max_inflight and not self.flow.on:
            return too_many_requests(self.max_inflight, RETRY_AFTER_S)
        return None

    @contextmanager
    def holding_body(self, client: str = "") -> Iterator[Callable[[int], None]]:
        """Count a body's bytes against the budget, and `client`'s share of it, while it is read and its request
        runs: yields `take(n)`, which refuses (429) the request whose next `n` bytes would pass either."""
        held = 0

        def take(n: int) -> None:
            nonlocal held
            if self.body_bytes + n > self.body_budget:
                raise _full(f"This server holds {self.body_bytes >> 20} MiB of request bodies, its limit")
            mine = self.client_bytes.get(client, 0)
            if client and mine + n > max(self.client_budget, self.body_limit()):
                raise _full(f"This client's requests hold {mine >> 20} MiB of request bodies here, its share")
            self.body_bytes += n
            self.client_bytes[client] = mine + n
            held += n

        try:
            yield take
        finally:
            self.body_bytes -= held
            left = self.client_bytes.pop(client, 0) - held
            if left > 0:
                self.client_bytes[client] = left

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Hold a slot, taken now, until the block ends."""
        self._take()
        try:
            yield
        finally:
            self._release()

    @asynccontextmanager
    async def slot(self, request: web.Request, body: bytes) -> AsyncIterator[None]:
        """Hold a slot until the block ends: a free one at once, else (flow control on) the one handed on to this
        request once it has waited its turn in the flow queue (or the 429 that ended its wait)."""
        who = self.flow.identify(request, body)  # a bad priority is a 400 whether or not it would wait
        if self.flow.on:
            request[PRIORITY] = who.priority
        if self.inflight < self.max_inflight and not self.flow.queued:
            self._take()
        else:
            await self.flow.wait(who, self._release)
        try:
            yield
        finally:
            self._release()

    def _take(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _release(self) -> None:
        if self.flow.hand_on():  # the slot goes on to the queue's next request, never free in between
            return
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    def start_drain(self) -> int:
        """Refuse new requests from now on, the queued ones too; returns how many are held."""
        self.draining = True
        self.flow.refuse_all(lambda: unavailable(DRAIN_MESSAGE, RETRY_AFTER_S, DRAINING))
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


def _full(held: str) -> APIError:
    message = f"{held}; retry in {RETRY_AFTER_S} s."
    return APIError(429, message, "requests", code="rate_limit_exceeded", retry_after=RETRY_AFTER_S)


def client_of(request: web.Request) -> str:
    """Whose share of the body budget a request takes: its API key's (`auth.caller_of`); "" (no share, the budget
    alone) where the server takes no keys — an address names no client behind a gateway or a load balancer,
    whose every request comes from one."""
    return caller_of(request)


def admission_middleware(admission: Admission, paths: frozenset[str] = GENERATION_PATHS):
    @web.middleware
    async def admit(request: web.Request, handler):
        if request.path not in paths:
            return await handler(request)
        if admission.is_leg(request):  # its client's request holds the slot and the body's bytes
            request[_BODY] = await read_body(request, admission.body_limit(), timeout_s=admission.body_timeout_s)
            return await handler(request)
        refusal = admission.refusal()
        if refusal is not None:
            raise refusal
        limit = admission.body_limit()
        check_length(request, limit)
        with admission.holding_body(
            client_of(request)
        ) as take:  # counted as the bytes arrive: a stalled upload holds what it sent
            request[_BODY] = await read_body(request, limit, take, admission.body_timeout_s)
            refusal = admission.refusal()  # the state may have changed while the body arrived
            if refusal is not None:
                raise refusal
            async with admission.slot(request, request[_BODY]):
                return await handler(request)

    return admit
