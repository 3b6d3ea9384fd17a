"""Which endpoint serves a request: the router's pool and policies (`router/workers.py`, `router/policies/`) over
the pods that take client traffic, within the gateway's subset hint, with shedding when all are full; in P/D mode
also which prefill computes its prompt.

Monolithic mode (no prefill configured): each endpoint is a `Worker` of role `ROLE` in the pool: a monolithic
instance computes the prompts it is sent, as a prefill does, so the policies score it as they score a prefill
(cache_aware: the prompt tokens it would compute, from its KV events, plus those of this picker's requests still
prefilling there; least_load; round robin). Under DP attention the attention group is the router's choice too
(`policies/groups.py`), named to the worker in the body (`data_parallel_rank`).

P/D mode (prefills configured): the endpoints are decodes (role "decode") and the prefills a second set of the
pool (role "prefill"); a request the decode hands off (`request_body.HANDED_OFF`) gets both, in the router's order
(`WorkerPool.pick_pair`): the decode first, scored by the policy as the router scores decodes, then the prefill, as
it scores prefills. The prefill is named to the decode in llm-d's header `x-prefiller-host-port`, and the decode runs
the prefill leg itself (`router/decode_handoff.py`), choosing the attention groups of its pair: the picker names
none. The subset hint and shedding apply to the endpoints (the decodes).

A request whose `model` names a LoRA adapter (docs/lora.md) goes only to endpoints (and prefills) that serve it,
as the workers' /health lists them, and first to those holding it resident while one is about as free
(`WorkerPool.cold`): the router's rules.

Refusals are the protocol's (the GIE endpoint picker protocol): 503 when no endpoint is ready or none of the
hint's is, or (P/D) no prefill is, or none serving the request's adapter is; 429 when every candidate holds
`max_queue` requests.
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
PREFILL, DECODE = "prefill", "decode"
# The body limit before any endpoint has said its context (`--max-body-bytes` 0): a 128k-token model, as the
# router's.
FALLBACK_CONTEXT = 131072
NO_ENDPOINT = "No endpoint of the pool is ready; retry later."
NO_ADAPTER = "No {role} serving LoRA adapter {model} is ready; retry later."
NONE_IN_SUBSET = "None of the endpoints the gateway allows (x-gateway-destination-endpoint-subset) is ready."
NO_PREFILL = "No prefill instance of the pool is ready; retry later."


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
    tokens it computes; in P/D mode the prefill picked with it (None: the request is not handed off) and the
    prompt tokens the prefill computes."""

    worker: Worker
    endpoints: tuple[str, ...]
    group: int | None
    tokens: int
    prefill: Worker | None = None
    prefill_tokens: int = 0

    @property
    def value(self) -> str:
        """The header's and the metadata's value: the endpoints, comma-separated, in order."""
        return ",".join(self.endpoints)

    @property
    def prefiller(self) -> str:
        """The value of `x-prefiller-host-port`: the prefill as `ip:port` ("" when none was picked)."""
        return address(self.prefill) if self.prefill is not None else ""


@dataclass
class Picker:
    pool: WorkerPool
    max_queue: int = 0  # requests an endpoint may hold before it takes no more (0: no bound)
    fallbacks: int = 0  # endpoints named after the picked one
    max_body_bytes: int = 0  # 0: from the endpoints' context
    pd: bool = False  # P/D mode: the endpoints are decodes, and the pool's prefills are picked beside them

    @property
    def role(self) -> str:
        """The role of the endpoints (the workers that take client traffic) in the pool."""
        return DECODE if self.pd else ROLE

    def ready(self) -> bool:
        """An endpoint is healthy (and, in P/D mode, a prefill too)."""
        healthy = any(w.healthy for w in self.pool.workers(self.role))
        return healthy and (not self.pd or any(w.healthy for w in self.pool.workers(PREFILL)))

    def adapters(self) -> list[str]:
        """The LoRA adapters a request may name: those a prefill and a decode both serve (P/D), or an endpoint."""
        if self.pd:
            return self.pool.adapters()
        return list(dict.fromkeys(a for w in self.pool.workers(self.role) for a in w.adapters))

    def body_limit(self) -> int:
        """--max-body-bytes, else the limit of the largest context an endpoint reported (`request/limits.py`)."""
        if self.max_body_bytes > 0:
            return self.max_body_bytes
        known = [w.max_model_len for w in self.pool.workers(self.role) if w.max_model_len]
        return body_limit_bytes(max(known) if known else FALLBACK_CONTEXT)

    def candidates(self, subset: frozenset[str] | None, adapter: str = "") -> list[Worker]:
        """The ready endpoints the request may go to (within `subset` when the gateway sent one; serving LoRA
        adapter `adapter` when it names one); 503 if none, 429 if all are full."""
        ready = [w for w in self.pool.workers(self.role) if w.healthy]
        if subset is not None:
            ready = [w for w in ready if address(w) in subset]
            if not ready:
                raise unavailable(NONE_IN_SUBSET, retry_after=1)
        if not ready:
            raise unavailable(NO_ENDPOINT, retry_after=1)
        ready = self._for_adapter(ready, adapter, "endpoint")
        if self.max_queue <= 0:
            return ready
        room = [w for w in ready if w.busy < self.max_queue]
        if not room:
            raise shed(self.max_queue)
        return room

    def prefills(self, adapter: str = "") -> list[Worker]:
        """The ready prefills (P/D mode), serving LoRA adapter `adapter` when it names one; 503 naming them if none
        is."""
        ready = [w for w in self.pool.workers(PREFILL) if w.healthy]
        if not ready:
            raise unavailable(NO_PREFILL, retry_after=1)
        return self._for_adapter(ready, adapter, "prefill")

    def _for_adapter(self, ready: list[Worker], adapter: str, what: str) -> list[Worker]:
        """Of `ready`, those serving LoRA adapter `adapter` (all for the base model: ""), those holding it resident
        first when one is about as free (`WorkerPool.cold`); 503 when none serves it."""
        if not adapter:
            return ready
        serving = [w for w in ready if adapter in w.adapters]
        if not serving:
            raise unavailable(NO_ADAPTER.format(role=what, model=adapter), retry_after=1)
        cold = self.pool.cold(adapter, set())
        return [w for w in serving if w not in cold] or serving

    def choose(
        self, prompt: Prompt | None, subset: frozenset[str] | None = None, handed_off: bool = False, adapter: str = ""
    ) -> Choice:
        """The endpoint for a request with `prompt` (None: not read), by the pool's policy, and its fallbacks by
        load; in P/D mode, when the decode hands the request off (`handed_off`), the prefill too; for LoRA adapter
        `adapter` ("": the base model) only those serving it. An `APIError` (503, 429) when none may take it. Opens
        the request on them (`prefilled` and `done` close it)."""
        candidates = self.candidates(subset, adapter)
        prefills = self.prefills(adapter) if self.pd and handed_off else []
        w = self.pool.routing.pick(self.role, candidates, prompt)
        # A decode receives the KV and names its own pair's groups; a monolithic endpoint computes the prompt.
        group, tokens = (None, 0) if self.pd else self.pool.group_for(w, secrets.randbits(63), prompt)
        rest = sorted((c for c in candidates if c is not w), key=by_load)[: self.fallbacks]
        w.take(group)
        w.add_tokens(tokens, group)
        p = self.pool.routing.pick(PREFILL, prefills, prompt) if prefills else None
        p_tokens = self.pool.uncached(p, prompt) if p is not None else 0
        if p is not None:
            p.take(None)
            p.add_tokens(p_tokens, None)
        return Choice(w, tuple(address(x) for x in (w, *rest)), group, tokens, p, p_tokens)

    @staticmethod
    def prefilled(c: Choice) -> None:
        """The endpoint answered (its response headers came): the prompt is computed, and a prefill's part of the
        request is over (a decode answers once the KV arrived)."""
        c.worker.release_tokens(c.tokens, c.group)
        if c.prefill is not None:
            c.prefill.release_tokens(c.prefill_tokens)
            c.prefill.give_back(None)

    @staticmethod
    def done(c: Choice) -> None:
        """The request ended."""
        c.worker.give_back(c.group)
