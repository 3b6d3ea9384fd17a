"""Which endpoint serves a request: the router's pool and policies (`router/workers.py`, `router/policies/`) over
the pods that take client traffic, within the gateway's subset hint, with shedding when all are full.

Each endpoint is a `Worker` of role `ROLE` in the pool: a monolithic instance computes the prompts it is sent,
as a prefill does, so the policies score it as they score a prefill (cache_aware: the prompt tokens it would
compute, from its KV events, plus those of this picker's requests still prefilling there; least_load; round
robin). Under DP attention the attention group is the router's choice too (`policies/groups.py`), named to the
worker in the body (`data_parallel_rank`).

Refusals are the protocol's (the GIE endpoint picker protocol): 503 when no endpoint is ready or none of the
hint's is, 429 when every candidate holds `max_queue` requests.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from disagg_worker.request.errors import APIError, unavailable
from disagg_worker.request.limits import body_limit_bytes
from disagg_worker.router.policies.least_load import by_load
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool

ROLE = "prefill"
# The body limit before any endpoint has said its context (`--max-body-bytes` 0): a 128k-token model, as the
# router's.
FALLBACK_CONTEXT = 131072
NO_ENDPOINT = "No endpoint of the pool is ready; retry later."
NONE_IN_SUBSET = "None of the endpoints the gateway allows (x-gateway-destination-endpoint-subset) is ready."


def address(w: Worker) -> str:
    """The endpoint as the gateway names it: `ip:port` (IPv6 in brackets)."""
    parts = urlsplit(w.url)
    host = parts.hostname or ""
    return f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"


def shed(limit: int) -> APIError:
    message = f"Every endpoint of the pool holds {limit} requests; retry later."
    return APIError(429, message, "requests", code="rate_limit_exceeded", retry_after=1)


@dataclass(frozen=True)
class Choice:
    """The endpoint picked (first of `endpoints`, the fallbacks after it), its attention group and the prompt
    tokens it computes."""

    worker: Worker
    endpoints: tuple[str, ...]
    group: int | None
    tokens: int

    @property
    def value(self) -> str:
        """The header's and the metadata's value: the endpoints, comma-separated, in order."""
        return ",".join(self.endpoints)


@dataclass
class Picker:
    pool: WorkerPool
    max_queue: int = 0  # requests an endpoint may hold before it takes no more (0: no bound)
    fallbacks: int = 0  # endpoints named after the picked one
    max_body_bytes: int = 0  # 0: from the endpoints' context

    def ready(self) -> bool:
        return any(w.healthy for w in self.pool.workers(ROLE))

    def body_limit(self) -> int:
        """--max-body-bytes, else the limit of the largest context an endpoint reported (`request/limits.py`)."""
        if self.max_body_bytes > 0:
            return self.max_body_bytes
        known = [w.max_model_len for w in self.pool.workers(ROLE) if w.max_model_len]
        return body_limit_bytes(max(known) if known else FALLBACK_CONTEXT)

    def candidates(self, subset: frozenset[str] | None) -> list[Worker]:
        """The ready endpoints the request may go to (within `subset` when the gateway sent one); 503 if none,
        429 if all are full."""
        ready = [w for w in self.pool.workers(ROLE) if w.healthy]
        if subset is not None:
            ready = [w for w in ready if address(w) in subset]
            if not ready:
                raise unavailable(NONE_IN_SUBSET, retry_after=1)
        if not ready:
            raise unavailable(NO_ENDPOINT, retry_after=1)
        if self.max_queue <= 0:
            return ready
        room = [w for w in ready if w.busy < self.max_queue]
        if not room:
            raise shed(self.max_queue)
        return room

    def choose(self, prompt: Prompt | None, subset: frozenset[str] | None = None) -> Choice:
        """The endpoint for a request with `prompt` (None: not read), by the pool's policy, and its fallbacks by
        load; an `APIError` (503, 429) when none may take it. Opens the request on it (`done` closes it)."""
        candidates = self.candidates(subset)
        w = self.pool.routing.pick(ROLE, candidates, prompt)
        group, tokens = self.pool.group_for(w, secrets.randbits(63), prompt)
        rest = sorted((c for c in candidates if c is not w), key=by_load)[: self.fallbacks]
        w.take(group)
        w.add_tokens(tokens, group)
        return Choice(w, tuple(address(x) for x in (w, *rest)), group, tokens)

    @staticmethod
    def prefilled(c: Choice) -> None:
        """The endpoint answered (its response headers came): the prompt is computed."""
        c.worker.release_tokens(c.tokens, c.group)

    @staticmethod
    def done(c: Choice) -> None:
        """The request ended."""
        c.worker.give_back(c.group)
