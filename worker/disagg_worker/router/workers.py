"""The router's workers: static ones plus those found through DNS (`discovery.py`), kept current each health
round, and the choice of the prefill/decode pair that serves the next request. The pool keeps the workers and
leaves out the unhealthy, the held out (a decode found stalled: `stall.py`) and the excluded (for a LoRA adapter:
the workers that do not serve it, `lacking`, and first those that do not hold it resident while one that does is
about as free, `cold`); which of the rest serves is its policy's (`policies/`), and under
DP attention which attention group (`policies/groups.py`). It also holds the router's counts of how requests were
routed (/health, /metrics).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from disagg_worker.request.errors import model_not_found
from disagg_worker.router import discovery
from disagg_worker.router.discovery import DnsSource
from disagg_worker.router.kv_index import KVIndex
from disagg_worker.router.policies import Policy, RoutingPolicy, groups, make_policy
from disagg_worker.router.policies.prefix import PrefixScore, Prompt
from disagg_worker.router.worker import GroupPolicy, Worker
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)


@dataclass
class WorkerPool:
    """Static workers plus those found through DNS; only available ones (healthy, not held out) are picked, by
    `policy`."""

    static: list[Worker] = field(default_factory=list)
    dns: list[DnsSource] = field(default_factory=list)
    policy: Policy = Policy.ROUND_ROBIN
    group_policy: GroupPolicy = GroupPolicy.LOAD
    discovered: dict[DnsSource, dict[str, Worker]] = field(default_factory=dict)
    # The workers' prefix caches, refreshed with their health (router/kv_index.py).
    kv_index: KVIndex = field(default_factory=KVIndex)
    # Headers of the router's own requests to workers (the worker token where workers require keys).
    worker_headers: dict[str, str] = field(default_factory=dict)
    # cache_aware's choices so far, by kind (/health, /metrics: `policies/cache_aware.py`).
    decisions: collections.Counter[str] = field(default_factory=collections.Counter)
    # Requests sent on, by path: "pd" (a prefill and a decode) or "decode_only" (Router.open).
    routes: collections.Counter[str] = field(default_factory=collections.Counter)
    # Requests held by an instance when it failed (Router.open): answered 500 and not retried on another.
    failed_instances: int = 0
    # Requests tried again on another pair before anything reached the client, by the side that failed (Router.open).
    retries: collections.Counter[str] = field(default_factory=collections.Counter)
    # Streams that went on on another pair when their decode failed, by cause (router/migrate.py).
    migrations: collections.Counter[str] = field(default_factory=collections.Counter)
    # Streams that stalled, by whose the stall was: "decode" (held out) or "request" (router/stall.py).
    stalls: collections.Counter[str] = field(default_factory=collections.Counter)
    # What the policy and the group choice score by, over this pool's index and counter (`policies/prefix.py`).
    score: PrefixScore = field(init=False)
    routing: RoutingPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.score = PrefixScore(self.kv_index, self.decisions)
        self.routing = make_policy(self.policy, self.score)

    @property
    def balance_tokens(self) -> int:
        """cache_aware's guard (`PrefixScore.balance_tokens`; --cache-aware-balance-tokens)."""
        return self.score.balance_tokens

    @balance_tokens.setter
    def balance_tokens(self, n: int) -> None:
        self.score.balance_tokens = n

    @property
    def decode_only_tokens(self) -> int:
        """Conditional disaggregation's threshold (`PrefixScore.decode_only_tokens`; --decode-only-tokens)."""
        return self.score.decode_only_tokens

    @decode_only_tokens.setter
    def decode_only_tokens(self, n: int) -> None:
        self.score.decode_only_tokens = n

    def workers(self, role: str | None = None) -> list[Worker]:
        found = [w for by_url in self.discovered.values() for w in by_url.values()]
        return [w for w in self.static + found if role is None or w.role == role]

    def pick(
        self, role: str, exclude: frozenset[Worker] | set[Worker] = frozenset(), prompt: Prompt | None = None
    ) -> Worker | None:
        """An available (healthy, not held out) `role` worker not in `exclude`, as the policy picks it for `prompt`;
        None if there is none."""
        now = time.monotonic()
        candidates = [w for w in self.workers(role) if w.available(now) and w not in exclude]
        return self.routing.pick(role, candidates, prompt) if candidates else None

    def pick_pair(
        self, exclude: frozenset[Worker] | set[Worker] = frozenset(), prompt: Prompt | None = None
    ) -> tuple[Worker | None, Worker] | None:
        """Decode first, then a prefill; (None, decode) when decode computes the prompt itself (`decode_only`)."""
        d = self.pick("decode", exclude, prompt)
        if d is None:
            return None
        if self.decode_only(d, prompt):
            return None, d
        p = self.pick("prefill", exclude, prompt)
        return (p, d) if p is not None else None

    def adapters(self) -> list[str]:
        """The LoRA adapters a pair could serve (a prefill and a decode hold each), in the order the workers list
        them: the router's /v1/models."""
        named = dict.fromkeys(a for w in self.workers() for a in w.adapters)
        held = [{a for w in self.workers(role) for a in w.adapters} for role in ("prefill", "decode")]
        return [a for a in named if all(a in h for h in held)]

    def lacking(self, model: str) -> set[Worker]:
        """The workers a request for `model` may not go to: for a LoRA adapter some worker serves, those that do
        not (none for any other name: the base model's, or one the workers refuse themselves). A 404 naming `model`
        when no pair could serve it (no prefill or no decode holds it, whatever their health)."""
        if not model or not any(model in w.adapters for w in self.workers()):
            return set()
        if model not in self.adapters():
            raise model_not_found(model)
        return {w for w in self.workers() if model not in w.adapters}

    def cold(self, model: str, exclude: frozenset[Worker] | set[Worker]) -> set[Worker]:
        """LoRA affinity: for a request of adapter `model`, the available workers of each role that serve it
        without holding it resident, when a resident one is about as free (`RouterTuning.lora_affinity_slack`);
        none for the base model, for a role where no instance holds it resident, or where those are far busier."""
        now = time.monotonic()
        out: set[Worker] = set()
        if not model:
            return out
        for role in ("prefill", "decode"):
            serving = [w for w in self.workers(role) if w.available(now) and w not in exclude and model in w.adapters]
            warm = [w for w in serving if model in w.resident]
            slack = TUNING.router.lora_affinity_slack
            if warm and min(w.busy for w in warm) <= min(w.busy for w in serving) + slack:
                out |= {w for w in serving if model not in w.resident}
        return out

    def decode_only(self, d: Worker, prompt: Prompt | None) -> bool:
        """Decode `d` computes the prompt itself, with no prefill (conditional disaggregation: the policy's)."""
        return self.routing.decode_only(d, prompt)

    def indexed(self, w: Worker) -> bool:
        """The router keeps an index of `w`'s prefix cache (the policy says whose)."""
        return self.routing.indexed(w)

    def uncached(self, w: Worker, prompt: Prompt | None) -> int:
        """Prompt tokens `w` would compute (at least one: the last token always runs)."""
        return self.score.uncached(w, prompt)

    def group_for(self, w: Worker, room: int, prompt: Prompt | None, local: bool = False) -> tuple[int | None, int]:
        """The attention group `w` runs a request on and the prompt tokens it computes there (`groups.py`)."""
        return groups.group_for(
            w, room, prompt, local=local, policy=self.group_policy, indexed=self.indexed(w), score=self.score
        )

    async def refresh_dns(self) -> None:
        await discovery.refresh_dns(self.dns, self.discovered)

    async def check_health(self, session: aiohttp.ClientSession) -> None:
        """Probe every worker; fetch the KV events of those healthy and indexed; forget the index of those gone."""

        async def one(w: Worker) -> None:
            await discovery.probe(session, w)
            if w.healthy and self.indexed(w):
                await discovery.fetch_kv_events(session, w, self.kv_index.of(w.url), self.worker_headers)

        workers = self.workers()
        await asyncio.gather(*(one(w) for w in workers))
        self.kv_index.forget({w.url for w in workers})

    async def watch(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Keep membership and health current until cancelled."""
        while True:
            try:
                await self.refresh_dns()
                await self.check_health(session)
            except Exception:  # one failed round must not stop the watching
                log.exception("worker refresh failed")
            await asyncio.sleep(interval_s)
