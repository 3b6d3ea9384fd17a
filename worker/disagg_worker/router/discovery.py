"""Who the router's workers are and how they are doing: DNS discovery of headless Services (`DnsSource`), the
health probe of each worker (/health, and /v1/models once for its context length), and the fetch of its prefix
cache's events into the router's index (/kv_events). `WorkerPool` (workers.py) runs them each health round.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass

import aiohttp

from disagg_worker.router.kv_index import InstanceIndex
from disagg_worker.router.worker import Worker
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)


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


async def refresh_dns(sources: list[DnsSource], discovered: dict[DnsSource, dict[str, Worker]]) -> None:
    """Each source's workers now, into `discovered`; a worker still there keeps its object (and its counts)."""
    for src in sources:
        known = discovered.get(src, {})
        urls = await src.resolve()
        discovered[src] = {u: known.get(u) or Worker(u, src.role, src.bootstrap_port) for u in urls}


async def probe(session: aiohttp.ClientSession, w: Worker) -> None:
    """One health probe: `w.healthy` and its report from its /health. A 503 or a refused connection takes it out at
    once; only `health_timeouts_to_unhealthy` timeouts in a row do (one late answer costs nothing)."""
    tuning = TUNING.router
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


async def fetch_kv_events(
    session: aiohttp.ClientSession, w: Worker, index: InstanceIndex, headers: dict[str, str]
) -> None:
    """What the worker's prefix cache stored and evicted since the last round, into its index."""
    try:
        timeout = aiohttp.ClientTimeout(total=TUNING.router.health_timeout_s)
        async with session.get(f"{w.url}/kv_events", params=index.query(), headers=headers, timeout=timeout) as r:
            if r.status != 200:
                index.problem = f"GET /kv_events answered {r.status}"
                return
            payload = await r.json()
        index.apply(payload, time.monotonic())
        index.problem = ""
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
        index.problem = f"GET /kv_events failed: {type(e).__name__}"


async def max_model_len(session: aiohttp.ClientSession, url: str) -> int:
    """The context a worker serves, from its /v1/models (as vLLM reports it); 0 if it does not say."""
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=3)) as r:
            body = await r.json()
        return int(body["data"][0]["max_model_len"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return 0
