"""The router's view of its workers: who they are (static list or DNS), whether they are healthy,
how loaded they are, and which prefill/decode pair serves the next request.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import time
from dataclasses import dataclass, field
from enum import Enum

import aiohttp

from disagg_worker.router.kv_index import KVIndex
from disagg_worker.router.worker import GroupPolicy, Worker
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)
# What a prompt's page found below a worker's cache saves, as a share of one found in it (which saves its whole
# compute): a page in host memory costs a copy over PCIe (on a GPU, ~20% of computing it for an 8B model), one in
# the store a read over the network (~40%); on a CPU both are far cheaper than compute, so these under-count there.
HOST_HIT = 0.8
STORE_HIT = 0.6


class Policy(str, Enum):
    """How a prefill and a decode are picked. LEAST_LOAD: the worker holding the fewest requests (`Worker.busy`:
    this router's open ones, or more when the worker reports more, other routers' included), then the lowest share
    of its KV pages in use. CACHE_AWARE (`router/kv_index.py`, needs `--tokenizer`): decode by least load; prefill
    by the lowest cost, the prompt's tokens the worker has not cached plus the uncached tokens of this router's
    prefills still running there, so a miss goes to the least loaded worker, not to the one that caches most. Guard:
    while some prefill worker is idle, one with `balance_tokens` or more pending takes no more (a stream of long
    prompts sharing a prefix does not pin one worker).

    Conditional disaggregation (`WorkerPool.decode_only_tokens` > 0, CACHE_AWARE only): decode is picked first;
    when the prompt tokens it lacks (its own prefix cache's index) are at most that many, it computes them
    itself and no prefill takes part (no bootstrap, no transfer)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"


@dataclass(frozen=True)
class Prompt:
    """What the router knows of a request's prompt: its length and the names of its whole pages."""

    tokens: int
    names: list[int]
    page_size: int


@dataclass(frozen=True)
class DnsSource:
    """A headless Service: every A record of `host` is a worker listening on `port`."""

    host: str
    port: int
    role: str
    bootstrap_port: int = 0

    @classmethod
    def parse(cls, spec: str, role: str, bootstrap_port: int = 0) -> DnsSource:
        host, _, port = spec.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"expected HOST:PORT, got {spec!r}")
        return cls(host, int(port), role, bootstrap_port)

    async def resolve(self) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return []
        ips = sorted({info[4][0] for info in infos})
        return [f"http://{ip}:{self.port}" for ip in ips]


@dataclass
class WorkerPool:
    """Static workers plus those found through DNS; only healthy ones are picked."""

    static: list[Worker] = field(default_factory=list)
    dns: list[DnsSource] = field(default_factory=list)
    policy: Policy = Policy.ROUND_ROBIN
    group_policy: GroupPolicy = GroupPolicy.LOAD
    discovered: dict[DnsSource, dict[str, Worker]] = field(default_factory=dict)
    # The workers' prefix caches, refreshed with their health (router/kv_index.py).
    kv_index: KVIndex = field(default_factory=KVIndex)
    # Headers of the router's own requests to workers (the worker token where workers require keys).
    worker_headers: dict[str, str] = field(default_factory=dict)
    # CACHE_AWARE's guard (see Policy) and its choices so far, by kind (/health).
    balance_tokens: int = 4096
    # Conditional disaggregation's threshold (see Policy; 0: every request goes through a prefill).
    decode_only_tokens: int = 0
    decisions: collections.Counter[str] = field(default_factory=collections.Counter)
    # Requests sent on, by path: "pd" (a prefill and a decode) or "decode_only" (Router.open).
    routes: collections.Counter[str] = field(default_factory=collections.Counter)
    # Requests held by an instance when it failed (Router.open): answered 500 and not retried on another.
    failed_instances: int = 0
    # Requests tried again on another pair before anything reached the client, by the side that failed (Router.open).
    retries: collections.Counter[str] = field(default_factory=collections.Counter)
    # Streams that went on on another pair when their decode failed, by cause (router/migrate.py).
    migrations: collections.Counter[str] = field(default_factory=collections.Counter)
    # One round-robin counter per role: with a shared one, equal numbers of prefill and decode workers made
    # every pick land on the same pair.
    _rr: dict[str, itertools.count] = field(default_factory=lambda: collections.defaultdict(itertools.count))

    def workers(self, role: str | None = None) -> list[Worker]:
        found = [w for by_url in self.discovered.values() for w in by_url.values()]
        return [w for w in self.static + found if role is None or w.role == role]

    def pick(
        self, role: str, exclude: frozenset[Worker] | set[Worker] = frozenset(), prompt: Prompt | None = None
    ) -> Worker | None:
        candidates = [w for w in self.workers(role) if w.healthy and w not in exclude]
        if not candidates:
            return None
        if self.policy is Policy.CACHE_AWARE and role == "prefill":
            return self._cache_aware(candidates, prompt)
        if self.policy in (Policy.LEAST_LOAD, Policy.CACHE_AWARE):
            return min(candidates, key=lambda w: (w.busy, w.kv_use, w.failures))
        return candidates[next(self._rr[role]) % len(candidates)]

    def pick_decode(
        self, exclude: frozenset[Worker] | set[Worker] = frozenset(), prompt: Prompt | None = None
    ) -> Worker | None:
        """Decode by the policy; with conditional disaggregation, the least loaded of those that could compute the
        prompt themselves when there is one (a follow-up turn goes back to the decode that holds its history)."""
        if self.decode_only_tokens > 0 and prompt is not None:
            able = [w for w in self.workers("decode") if w.healthy and w not in exclude and self._could(w, prompt)]
            if able:
                return min(able, key=lambda w: (w.busy, self.uncached(w, prompt), w.failures))
        return self.pick("decode", exclude)

    def pick_pair(
        self, exclude: frozenset[Worker] | set[Worker] = frozenset(), prompt: Prompt | None = None
    ) -> tuple[Worker | None, Worker] | None:
        """A prefill and a decode; (None, decode) when decode computes the prompt itself (`decode_only`)."""
        d = self.pick_decode(exclude, prompt)
        if d is None:
            return None
        if self.decode_only(d, prompt):
            return None, d
        p = self.pick("prefill", exclude, prompt)
        return (p, d) if p is not None else None

    def decode_only(self, d: Worker, prompt: Prompt | None) -> bool:
        """Decode `d` lacks few enough of the prompt's tokens to compute them itself (conditional disaggregation);
        counted as a routing decision."""
        if prompt is None or self.decode_only_tokens <= 0 or not self._could(d, prompt):
            return False
        self.decisions["decode_only"] += 1
        return True

    def _could(self, d: Worker, prompt: Prompt) -> bool:
        """`d` says it computes prompts itself (`local_prefill` on its /health) and lacks few enough of this one's."""
        return d.report.get("local_prefill") is True and self.uncached(d, prompt) <= self.decode_only_tokens

    def indexed(self, w: Worker) -> bool:
        """The router keeps an index of `w`'s prefix cache: prefill under CACHE_AWARE, decode too when it may
        compute prompts itself."""
        return self.policy is Policy.CACHE_AWARE and (w.role == "prefill" or self.decode_only_tokens > 0)

    def uncached(self, w: Worker, prompt: Prompt | None) -> int:
        """Prompt tokens `w` would compute (at least one: the last token always runs)."""
        if prompt is None:
            return 0
        now = time.monotonic()
        cached = self.kv_index.cached_pages(w.url, prompt.names, now)
        host, store = self.kv_index.tiers(w.url, prompt.names, cached, now)
        hit = (cached + HOST_HIT * host + STORE_HIT * store) * prompt.page_size
        return max(prompt.tokens - int(hit), 1)

    def group_for(self, w: Worker, room: int, prompt: Prompt | None, local: bool = False) -> tuple[int | None, int]:
        """The attention group `w` runs a request on (None: it runs one) and the prompt tokens it computes there
        (0 for a decode receiving the KV). With DP attention and an index of `w`'s groups (CACHE_AWARE): a
        prefill (group policy LOAD) takes the group with the lowest cost, uncached tokens plus this router's
        pending ones there, guarded like the workers (an idle group takes over from one with `balance_tokens`
        pending); a decode computing the prompt itself (`local`, whatever the group policy) the group holding
        most of it, as judged when it was picked; a decode receiving the KV (group policy LOAD) the least loaded
        group, then the one holding most (fewer pages to transfer). Otherwise the group policy alone."""
        loads = w.dp_loads
        receives = w.role == "decode" and not local
        if (
            not loads
            or prompt is None
            or not self.indexed(w)
            or (self.group_policy is not GroupPolicy.LOAD and not local)
        ):
            return w.pick_group(self.group_policy, room), 0 if receives else self.uncached(w, prompt)
        now = time.monotonic()
        hit = {g: self.kv_index.cached_pages(w.url, prompt.names, now, g) * prompt.page_size for g in range(len(loads))}
        uncached = {g: max(prompt.tokens - hit[g], 1) for g in hit}
        inflight, pending = w.group_inflight, w.group_pending
        if receives:
            return min(uncached, key=lambda g: (inflight.get(g, 0), loads[g], uncached[g], g)), 0
        cost = {g: uncached[g] + pending.get(g, 0) for g in uncached}
        best = min(cost, key=lambda g: (cost[g], inflight.get(g, 0), loads[g], g))
        idle = [g for g in cost if not pending.get(g) and not inflight.get(g)]
        if idle and best not in idle and pending.get(best, 0) >= self.balance_tokens:
            moved = min(idle, key=lambda g: (cost[g], loads[g], g))
            # A prefill's `pick` counted a cache hit the request no longer gets: taken back in the same step of the
            # event loop as the pick (no await between), so a scrape of the counter never sees it go down.
            if not local and uncached[moved] >= prompt.tokens > min(uncached.values()):
                self.decisions["cache_hit"] -= 1
                self.decisions["balanced"] += 1
            best = moved
        return best, uncached[best]

    def _cache_aware(self, candidates: list[Worker], prompt: Prompt | None) -> Worker:
        cost = {w: self.uncached(w, prompt) + w.pending_tokens for w in candidates}
        best = min(candidates, key=lambda w: (cost[w], w.inflight, w.failures))
        idle = [w for w in candidates if w.pending_tokens == 0 and w.inflight == 0]
        if idle and best not in idle and best.pending_tokens >= self.balance_tokens:
            self.decisions["balanced"] += prompt is not None
            return min(idle, key=lambda w: (cost[w], w.failures))
        if prompt is not None:  # a request's choice (readiness checks pick without a prompt)
            self.decisions["cache_hit" if self.uncached(best, prompt) < prompt.tokens else "load"] += 1
        return best

    async def refresh_dns(self) -> None:
        for src in self.dns:
            known = self.discovered.get(src, {})
            urls = await src.resolve()
            self.discovered[src] = {u: known.get(u) or Worker(u, src.role, src.bootstrap_port) for u in urls}

    async def check_health(self, session: aiohttp.ClientSession) -> None:
        tuning = TUNING.router

        async def probe(w: Worker) -> None:
            try:
                timeout = aiohttp.ClientTimeout(total=tuning.health_timeout_s)
                async with session.get(f"{w.url}/health", timeout=timeout) as r:
                    ok = r.status == 200
                    w.take_report(await r.read())
                w.health_timeouts = 0
            except asyncio.TimeoutError:
                w.health_timeouts += 1
                ok = w.healthy and w.health_timeouts < tuning.health_timeouts_to_unhealthy
            except aiohttp.ClientError:
                ok = False
            if ok != w.healthy:
                log.info("%s worker %s is now %s", w.role, w.url, "healthy" if ok else "unhealthy")
            w.healthy = ok
            if ok and not w.max_model_len:
                w.max_model_len = await max_model_len(session, w.url)
            if ok and self.indexed(w):
                await self.fetch_kv_events(session, w)

        workers = self.workers()
        await asyncio.gather(*(probe(w) for w in workers))
        self.kv_index.forget({w.url for w in workers})

    async def fetch_kv_events(self, session: aiohttp.ClientSession, w: Worker) -> None:
        """What the worker's prefix cache stored and evicted since the last round, into the index."""
        index = self.kv_index.of(w.url)
        try:
            timeout = aiohttp.ClientTimeout(total=TUNING.router.health_timeout_s)
            url, query, headers = f"{w.url}/kv_events", index.query(), self.worker_headers
            async with session.get(url, params=query, headers=headers, timeout=timeout) as r:
                if r.status != 200:
                    index.problem = f"GET /kv_events answered {r.status}"
                    return
                payload = await r.json()
            index.apply(payload, time.monotonic())
            index.problem = ""
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
            index.problem = f"GET /kv_events failed: {type(e).__name__}"

    async def watch(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Keep membership and health current until cancelled."""
        while True:
            try:
                await self.refresh_dns()
                await self.check_health(session)
            except Exception:  # one failed round must not stop the watching
                log.exception("worker refresh failed")
            await asyncio.sleep(interval_s)


async def max_model_len(session: aiohttp.ClientSession, url: str) -> int:
    """The context a worker serves, from its /v1/models (as vLLM reports it); 0 if it does not say."""
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=3)) as r:
            body = await r.json()
        return int(body["data"][0]["max_model_len"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return 0
